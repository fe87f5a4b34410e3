"""Learning-rate schedules: cycles of warmup, a stable plateau and a decay (WSD, WSD-S, cosine, ...).

Training is split into cycles (one by default). Each cycle warms up linearly (from 0 in
the first cycle, from the floor in later ones with ``rewarmup``), holds the peak, then
decays to ``min_lr_ratio * peak`` over its last ``decay`` steps with the chosen shape.
With no ``decay`` the whole cycle after warmup decays (the classic warmup + cosine).
``cycle_peaks`` gives each cycle its own peak (a multiple of the peak; the floor stays
``min_lr_ratio * peak``), e.g. a peak stepped down from cycle to cycle.
Warmup, rewarmup and decay are fractions of the cycle if < 1, else step counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp

from loomax.config import ConfigError

SCHEDULES = ("constant", "linear", "cosine", "inv_sqrt", "inv")


def steps_of(value: float | int, total: int, name: str) -> int:
    """A fraction of ``total`` (< 1) or an absolute number of steps (>= 1), as steps."""
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    if value < 1:
        return int(round(value * total))
    if value != int(value):
        raise ConfigError(f"{name} must be a fraction < 1 or a whole number of steps, got {value}")
    return int(value)


def cycle_ends(
    num_train_steps: int,
    cycles: int | Sequence[int] | None = None,
    cycle_length: float | Sequence[float] | None = None,
) -> list[int]:
    """The step at which each cycle ends; the last is always ``num_train_steps``.

    ``cycles`` is a number of equal cycles or a list of cycle-end steps; ``cycle_length``
    a length (steps, or a fraction of training if < 1) repeated to the end, or a list of
    lengths (the last cycle runs to the end). Giving both is an error.
    """
    if cycles is not None and cycle_length is not None:
        raise ConfigError("optimizer.cycles and optimizer.cycle_length: give one of them, not both")
    total = num_train_steps
    if cycles is None and cycle_length is None:
        return [total]
    if isinstance(cycles, int):
        if cycles < 1:
            raise ConfigError(f"optimizer.cycles must be >= 1, got {cycles}")
        ends = [round(total * (i + 1) / cycles) for i in range(cycles)]
    elif cycles is not None:
        ends = [int(c) for c in cycles]
        name = "optimizer.cycles"
        if any(b <= a for a, b in zip([0, *ends], ends, strict=False)) or ends[-1] > total:
            raise ConfigError(
                f"{name} must be increasing steps in (0, {total}] (num_train_steps), got {list(cycles)}"
            )
    elif isinstance(cycle_length, int | float):
        length = steps_of(cycle_length, total, "optimizer.cycle_length")
        if length < 1:
            raise ConfigError(f"optimizer.cycle_length must give >= 1 step, got {cycle_length}")
        ends = list(range(length, total + 1, length))
    else:
        lengths = [steps_of(c, total, "optimizer.cycle_length") for c in cycle_length]
        if not lengths or min(lengths) < 1:
            raise ConfigError(
                f"optimizer.cycle_length must be lengths of >= 1 step, got {cycle_length}"
            )
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        if ends[-1] > total:
            raise ConfigError(
                f"optimizer.cycle_length {list(cycle_length)} adds up to {ends[-1]} steps, "
                f"more than num_train_steps ({total})"
            )
    if not ends or ends[-1] < total:
        ends.append(total)
    return ends


@dataclass(frozen=True)
class Phase:
    """A stretch of the schedule: ``[start, end)`` steps, its kind and the LR at both ends."""

    cycle: int
    kind: str
    start: int
    end: int
    lr_start: float
    lr_end: float

    def __str__(self) -> str:
        return (
            f"cycle {self.cycle} {self.kind:<8} steps {self.start:>7}-{self.end:<7} "
            f"lr {self.lr_start:.3g} -> {self.lr_end:.3g}"
        )


@dataclass(frozen=True)
class _Cycle:
    start: int
    end: int
    warmup: int
    stable: int
    decay: int
    warm_from: float
    peak: float


class LrSchedule:
    """An optax schedule (``schedule(step) -> lr``) that also lists its ``phases``."""

    def __init__(
        self,
        kind: str,
        peak: float,
        num_train_steps: int,
        warmup: float = 0.0,
        min_lr_ratio: float = 0.0,
        *,
        decay: float | None = None,
        cycles: int | Sequence[int] | None = None,
        cycle_length: float | Sequence[float] | None = None,
        rewarmup: float = 0.0,
        timescale: float | None = None,
        cycle_peaks: Sequence[float] | None = None,
    ):
        if kind not in SCHEDULES:
            raise ConfigError(f"optimizer.lr_schedule must be one of {SCHEDULES}, got {kind!r}")
        if num_train_steps < 1:
            raise ConfigError(f"num_train_steps must be >= 1, got {num_train_steps}")
        self.kind, self.peak, self.num_train_steps = kind, float(peak), num_train_steps
        self.floor = float(peak) * min_lr_ratio
        self.cycles: list[_Cycle] = []
        start = 0
        ends = cycle_ends(num_train_steps, cycles, cycle_length)
        if cycle_peaks is not None and (
            len(cycle_peaks) != len(ends) or any(p <= 0 for p in cycle_peaks)
        ):
            raise ConfigError(
                f"optimizer.cycle_peaks needs one positive multiple per cycle ({len(ends)}), "
                f"got {list(cycle_peaks)}"
            )
        for i, end in enumerate(ends):
            n = end - start
            name = "optimizer.warmup" if i == 0 else "optimizer.rewarmup"
            warm = steps_of(warmup if i == 0 else rewarmup, n, name)
            dec = n - warm if decay is None else steps_of(decay, n, "optimizer.decay")
            if warm + dec > n:
                raise ConfigError(
                    f"cycle {i} (steps {start}-{end}) is {n} steps: {name} ({warm} steps) plus "
                    f"optimizer.decay ({dec} steps) do not fit in it"
                )
            warm_from = 0.0 if i == 0 else self.floor
            peak_i = self.peak * (1.0 if cycle_peaks is None else float(cycle_peaks[i]))
            self.cycles.append(_Cycle(start, end, warm, n - warm - dec, dec, warm_from, peak_i))
            start = end
        first_warmup = self.cycles[0].warmup
        self.timescale = float(timescale if timescale is not None else max(first_warmup, 1))
        if self.timescale <= 0:
            raise ConfigError(f"optimizer.timescale must be > 0, got {timescale}")

    def _decayed(self, d, length: int, peak: float):
        floor = self.floor
        if self.kind == "constant":
            return jnp.full_like(d, peak)
        if self.kind in ("inv_sqrt", "inv"):
            ratio = self.timescale / (self.timescale + d)
            value = peak * (jnp.sqrt(ratio) if self.kind == "inv_sqrt" else ratio)
            return jnp.maximum(value, floor)
        frac = jnp.clip(d / max(length, 1), 0.0, 1.0)
        if self.kind == "linear":
            return peak + (floor - peak) * frac
        return floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * frac))

    def _in_cycle(self, c: _Cycle, u):
        warm = c.warm_from + (c.peak - c.warm_from) * jnp.minimum((u + 1) / max(c.warmup, 1), 1)
        decay_start = c.warmup + c.stable
        value = jnp.where(u < decay_start, c.peak, self._decayed(u - decay_start, c.decay, c.peak))
        return jnp.where(u < c.warmup, warm, value)

    def __call__(self, step):
        step = jnp.asarray(step, jnp.float32)
        out = self._in_cycle(self.cycles[-1], step - self.cycles[-1].start)
        for c in reversed(self.cycles[:-1]):
            out = jnp.where(step < c.end, self._in_cycle(c, step - c.start), out)
        return out

    def phases(self) -> list[Phase]:
        """Warmup, stable and decay stretches of every cycle (empty ones left out)."""
        out = []
        for i, c in enumerate(self.cycles):
            a = c.start
            for kind, n in (("warmup", c.warmup), ("stable", c.stable), ("decay", c.decay)):
                if n:
                    last = a + n if kind == "decay" and c.end == self.num_train_steps else a + n - 1
                    name = self.kind if kind == "decay" else kind
                    out.append(Phase(i, name, a, a + n, float(self(a)), float(self(last))))
                a += n
        return out


def warmup_then_decay(
    kind: str, peak: float, num_train_steps: int, warmup: float, min_lr_ratio: float, **cycles
) -> LrSchedule:
    """Linear warmup to ``peak``, then ``kind`` decay to ``min_lr_ratio * peak`` (see ``LrSchedule``)."""
    return LrSchedule(kind, peak, num_train_steps, warmup, min_lr_ratio, **cycles)
