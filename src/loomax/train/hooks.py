"""Hooks: host-side functions the trainer runs after the steps they are due on.

A hook sees a ``StepInfo``. Pulling device values from it (``info.loss``,
``info.host_metrics()``) waits for that step to finish, so hooks that run every step
should use ``info.previous`` (the step before, already finished) instead. Through
``info.control`` a hook asks for a stop, a save or an eval at the end of the step.

A ``Hook`` may also shape the step before training starts: ``wrap_optimizer`` (e.g.
skip bad steps), ``jit_hooks`` (metrics computed inside the step) and ``state_extras``
(arrays kept in ``TrainerState.extras``, e.g. EMA weights); and ``transform_batch``
changes each batch before it is sharded (sequence-length warm-up).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np
import optax

from loomax.train.control import Control
from loomax.train.hook_config import HookConfig, HookContext
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, StateExtra


@dataclass(frozen=True)
class CompletedStep:
    """A step that has finished on the device, with its metrics on the host."""

    step: int
    metrics: dict[str, float]
    duration: float
    """Seconds between this step's completion and the previous one's (the step time)."""
    finished_at: float
    """``time.perf_counter()`` when the host saw the step finish."""


@dataclass
class StepInfo:
    """What hooks receive after step ``step`` (the number of steps done) is dispatched."""

    step: int
    state: TrainerState
    metrics: dict[str, jax.Array]
    previous: CompletedStep | None = None
    """The step before this one, already finished: reading it never blocks."""
    record: dict[str, Any] = field(default_factory=dict)
    """Values to log for this step; the trainer sends them to the tracker after the hooks."""
    dispatched_at: float | None = None
    """``time.perf_counter()`` when the step was handed to the device."""
    control: Control = field(default_factory=Control)
    """Where hooks request ``stop``, ``save`` or ``eval`` at the end of this step."""
    run_dir: Path | None = None
    """The run directory (hooks write their files under it)."""
    eval_weights: str | None = None
    """Name of the ``state.extras`` entry to evaluate instead of the model's weights (EMA)."""
    traced_outputs: dict[int, dict[str, jax.Array]] = field(default_factory=dict)
    """What each ``JitHook`` computed in this step, by ``id`` of the JitHook (see ``traced``)."""
    per_worker: bool = False
    """DiLoCo: each metric holds one value per worker; on the host, their mean over the
    workers this process holds (all of them in a one-process run)."""
    epoch: int | None = None
    """The epoch (from 0) this step belongs to, when the trainer knows its epoch size."""
    _host: dict[str, float] | None = None
    _finished_at: float | None = None

    def host_metrics(self) -> dict[str, float]:
        """This step's metrics as floats (waits for the step to finish)."""
        if self._host is None:
            if self.per_worker:
                self._host = {k: host_mean(v) for k, v in self.metrics.items()}
            else:
                self._host = {k: _to_host(v) for k, v in jax.device_get(self.metrics).items()}
            self._finished_at = time.perf_counter()
        return self._host

    def traced(self, jit_hook: JitHook) -> dict[str, Any]:
        """What ``jit_hook`` computed inside this step, on the host (waits for the step).

        Only the hook that owns ``jit_hook`` reads it, on the steps it is due; the values
        never join the shared ``metrics``.
        """
        outputs = self.traced_outputs[id(jit_hook)]
        return {k: _to_host(v) for k, v in jax.device_get(outputs).items()}

    @property
    def step_duration(self) -> float | None:
        """Seconds this step took on the device (waits for it to finish).

        Measured from when it could start: the previous step's end, or its dispatch.
        """
        self.host_metrics()
        starts = [t for t in (self.dispatched_at, self.previous and self.previous.finished_at) if t]
        return self._finished_at - max(starts) if starts and self._finished_at else None

    @property
    def loss(self) -> float:
        """This step's training loss (waits for the step to finish)."""
        return self.host_metrics()["train/loss"]

    @property
    def eval_model(self) -> Any:
        """The model evaluators should use: the trained one, or the EMA weights if asked."""
        if self.eval_weights is None:
            return self.state.model
        params = self.state.extras[self.eval_weights]
        return eqx.combine(params, eqx.filter(self.state.model, eqx.is_inexact_array, inverse=True))

    def log(self, values: dict[str, Any]) -> None:
        """Add ``values`` to what is logged for this step."""
        self.record.update(values)


def host_mean(value: jax.Array) -> float:
    """A per-worker metric on the host: the mean over the workers this process holds."""
    if value.is_fully_addressable:
        return float(np.mean(np.asarray(jax.device_get(value))))
    shards = {str(s.index): np.asarray(s.data) for s in value.addressable_shards}
    return float(np.mean(np.concatenate([np.ravel(v) for v in shards.values()])))


def _to_host(value) -> Any:
    return value.item() if getattr(value, "size", 2) == 1 else value


class Hook:
    """A host-side hook. Subclasses override the methods they need.

    ``on_step`` runs on every step divisible by ``every``; ``on_train_begin`` runs once
    with the initial state (``step`` is the starting step), ``on_train_end`` once with
    the final one. Hooks run by ``priority`` (higher first), then in registration order.

    A hook with settings declares them once, in a nested frozen ``Config(HookConfig)``
    registered by ``@hook_type(name)``; ``Hook(config)`` or ``Hook(**settings)`` builds
    it, and it reads them as ``self.config`` (an ``every`` field sets ``self.every``, unless
    ``sees_every_step``).
    ``from_config`` is how a run builds it from YAML, with what the run knows.
    """

    Config: ClassVar[type[HookConfig] | None] = None
    every: int = 1
    priority: int = 0
    sees_every_step: ClassVar[bool] = False
    """True for a hook whose ``on_step`` must see every step although its config has an
    ``every`` (it keeps its own cadence with it, e.g. of logging)."""

    def __init__(self, config: HookConfig | None = None, /, **settings: Any):
        if self.Config is None:
            if config is not None or settings:
                raise TypeError(f"{type(self).__name__} takes no settings")
            return
        if config is None:
            config = self.Config(**settings)
        elif settings:
            config = dataclasses.replace(config, **settings)
        self.config = config
        if not self.sees_every_step:
            self.every = getattr(config, "every", type(self).every)

    @classmethod
    def from_config(cls, config: HookConfig, context: HookContext) -> Hook | list[Hook]:
        """The hook of ``config`` in a run (override to take what it needs from ``context``)."""
        return cls(config)

    def output_directory(self, run_dir: str | Path | None, name: str) -> Path:
        """Where the hook writes: its config's ``directory``, else ``run_dir/name``."""
        directory = getattr(self.config, "directory", None)
        if directory is None and run_dir is None:
            raise ValueError(f"{type(self).__name__} needs a directory or a run_dir")
        return Path(directory) if directory else Path(run_dir) / name

    @property
    def name(self) -> str:
        """How logs and control requests name this hook."""
        return getattr(self, "state_key", None) or type(self).__name__

    # --------------------------------------------------------------- before training
    def wrap_optimizer(
        self, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        """Return the optimizer to train with (called once, when the hook is added)."""
        return optimizer

    def jit_hooks(self) -> list[JitHook]:
        """Metrics this hook computes inside the step."""
        return []

    def state_extras(self) -> dict[str, StateExtra]:
        """Arrays this hook keeps in ``TrainerState.extras``, by name."""
        return {}

    def activation_stats_at(self, step: int) -> bool:
        """Whether step ``step`` should take activation statistics (``loomax.models.blocks.taps``):
        that step runs a second compiled variant of the step that also returns them."""
        return False

    def transform_batch(self, step: int, batch: Any) -> Any:
        """The batch step ``step`` trains on (this process's rows, before sharding); default: as is."""
        return batch

    # --------------------------------------------------------------- lifecycle
    def on_train_begin(self, info: StepInfo) -> None:
        """Called before the first step."""

    def on_epoch_begin(self, info: StepInfo, epoch: int) -> None:
        """Called before the first step of ``epoch`` (from 0); ``info`` is the step before."""

    def on_step_begin(self, step: int) -> None:
        """Called before step ``step`` (divisible by ``every``) is dispatched."""

    def on_step(self, info: StepInfo) -> None:
        """Called after each step divisible by ``every``."""

    def on_epoch_end(self, info: StepInfo, epoch: int) -> None:
        """Called after the last step of ``epoch`` (after its ``on_step``)."""

    def run_eval(self, info: StepInfo) -> dict[str, float] | None:
        """Evaluators return their results here when an eval is due (others return None)."""
        return None

    def on_eval(self, info: StepInfo, results: dict[str, float]) -> None:
        """Called after an evaluation with its results (e.g. ``eval/loss``)."""

    def blocks_temporary_saves(self, step: int) -> bool:
        """Whether the temporary checkpoint due at the end of ``step`` must wait (e.g. while the
        hook's own state is mid-way through something a resume could not repeat). Permanent
        saves, and the save when the run stops, are never held back."""
        return False

    def checkpoint_files(self) -> dict[str, bytes]:
        """Files (name -> bytes) to write into each checkpoint directory (e.g. the config)."""
        return {}

    def on_save(self, info: StepInfo, path: str) -> None:
        """Called after a checkpoint of ``info.step`` was started at ``path`` (URL)."""

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        """Add, change or drop entries of ``record`` before it reaches the tracker."""

    def on_train_end(self, info: StepInfo) -> None:
        """Called after the last step, once its metrics are on the host."""

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        """Called when training fails with ``error`` (it is re-raised afterwards)."""

    def state_dict(self) -> dict[str, Any] | None:
        """State to save in checkpoints (JSON values), or None for a stateless hook."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (called before ``on_train_begin`` on resume)."""


def hook_state_keys(hooks: list[Hook]) -> dict[str, Hook]:
    """Stateful hooks by the key their state is saved under.

    The key is the hook's ``state_key`` attribute if it has one, else its class name,
    with ``#2``, ``#3``... for further hooks of the same name (in registration order).
    """
    out: dict[str, Hook] = {}
    for hook in hooks:
        if hook.state_dict() is None:
            continue
        base = hook.name
        key, n = base, 1
        while key in out:
            n += 1
            key = f"{base}#{n}"
        out[key] = hook
    return out


class FnHook(Hook):
    """A plain function of ``StepInfo`` run every ``every`` steps."""

    def __init__(self, fn: Callable[[StepInfo], Any], every: int = 1, priority: int = 0):
        super().__init__()
        if every < 1:
            raise ValueError(f"hook every must be >= 1, got {every}")
        self.fn = fn
        self.every = every
        self.priority = priority

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "FnHook")

    def on_step(self, info: StepInfo) -> None:
        self.fn(info)
