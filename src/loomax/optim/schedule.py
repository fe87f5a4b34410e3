"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "linear", "cosine")


def steps_of(value: float | int, num_train_steps: int, name: str) -> int:
    """A fraction of training (< 1) or an absolute number of steps (>= 1), as steps."""
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value < 1:
        return int(round(value * num_train_steps))
    if value != int(value):
        raise ValueError(f"{name} must be a fraction < 1 or a whole number of steps, got {value}")
    return int(value)


def warmup_then_decay(
    kind: str, peak: float, num_train_steps: int, warmup: float, min_lr_ratio: float
) -> optax.Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup``, then ``kind`` decay to ``min_lr_ratio * peak``.

    ``warmup`` is a fraction of training if < 1, else a number of steps. Decay ends at
    ``num_train_steps``; the schedule is constant after that.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"optimizer.lr_schedule must be one of {SCHEDULES}, got {kind!r}")
    warmup_steps = steps_of(warmup, num_train_steps, "optimizer.warmup")
    floor = peak * min_lr_ratio
    decay_steps = max(num_train_steps - warmup_steps, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((step + 1) / max(warmup_steps, 1), 1.0) if warmup_steps else peak
        frac = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        if kind == "constant":
            decayed = jnp.asarray(peak, jnp.float32)
        elif kind == "linear":
            decayed = peak + (floor - peak) * frac
        else:
            decayed = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * frac))
        return jnp.where(step < warmup_steps, warm, decayed)

    return schedule
