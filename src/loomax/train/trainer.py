"""The trainer: jit the pure step once, run it in a loop, and run hooks around it."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from loomax.distributed import DistributedConfig
from loomax.mesh import (
    AxisMappings,
    MeshConfig,
    batch_sharding,
    data_parallel_size,
    make_axis_mappings,
    replicated,
)
from loomax.tracking import JsonlTrackerConfig, Tracker, TrackerConfig, build_tracker
from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, LossFn, make_train_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` section: loop length, batch, precision, logging and eval cadence."""

    seed: int = 0
    """Seed of model initialisation, data order and every other random choice."""
    num_train_steps: int = 1000
    """Optimizer steps to take."""
    train_batch_size: int = 32
    """Sequences per optimizer step, over all devices."""
    per_device_parallelism: int = -1
    """Sequences per device per forward/backward; smaller than the batch per device means gradient accumulation. -1 = the whole batch."""
    mp: str = "f32"
    """jmp precision policy, e.g. f32 or p=f32,c=bfloat16 (params, compute, output)."""
    run_id: str | None = None
    """Name of the run; null = a timestamp."""
    run_dir: str | None = None
    """Where the run writes its files; null = runs/<run_id>."""
    log_every: int = 10
    """Send metrics to the tracker every this many steps (and at the last step)."""
    steps_per_eval: int = 1000
    """Evaluate on the validation data every this many steps (and at the last step)."""
    max_eval_batches: int | None = 10
    """Evaluate on at most this many validation batches; null = all of them."""
    eval_batch_size: int | None = None
    """Sequences per eval batch; null = train_batch_size."""
    eval_at_start: bool = True
    """Also evaluate before the first step."""
    crash_on_nan: bool = True
    """Stop with an error as soon as the training loss is NaN or infinite."""
    progress_bar: bool = True
    """Show a tqdm progress bar with loss and tokens/s."""
    max_train_time: timedelta | None = None
    """Stop cleanly (final eval and log) after this much wall time, e.g. 4m or 2h; null = no limit."""
    device_peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; null = known table or, on CPU, a matmul probe."""
    tracker: TrackerConfig | list[TrackerConfig] = field(default_factory=JsonlTrackerConfig)
    """Where metrics go: one tracker config (type: jsonl, noop) or a list of them."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh sizes: replica, data, model (one may be -1 to fill the devices)."""
    batch_axis: str = "batch"
    """Logical axis split over the data-parallel mesh axes (replica, data)."""
    fsdp_axis: str | list[str] | None = "embed"
    """Logical axis (or axes) of parameters and optimizer state split over `data` (FSDP); null = replicate."""
    tensor_parallel_axes: list[str] = field(default_factory=lambda: ["mlp", "heads"])
    """Logical axes split over `model` (tensor parallelism; only matters when mesh.model > 1)."""
    axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: logical axis -> mesh axis (or list) for both mappings, applied after the basic fields."""
    parameter_axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: overrides for the parameter mapping only (how params and optimizer state rest)."""
    compute_axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: overrides for the compute mapping only (how activations are laid out)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process settings (jax.distributed); auto-detected on SLURM and TPU pods."""

    def __post_init__(self):
        positive = ("num_train_steps", "train_batch_size", "log_every", "steps_per_eval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        if self.per_device_parallelism == 0 or self.per_device_parallelism < -1:
            raise ValueError(
                f"trainer.per_device_parallelism must be > 0 or -1, got {self.per_device_parallelism}"
            )
        if self.max_eval_batches is not None and self.max_eval_batches <= 0:
            raise ValueError(
                f"trainer.max_eval_batches must be > 0 or null, got {self.max_eval_batches}"
            )
        if self.eval_batch_size is not None and self.eval_batch_size <= 0:
            raise ValueError(
                f"trainer.eval_batch_size must be > 0 or null, got {self.eval_batch_size}"
            )
        try:
            jmp.get_policy(self.mp)
        except (ValueError, KeyError) as e:
            raise ValueError(f"trainer.mp: cannot parse precision policy {self.mp!r} ({e})") from e
        self.axis_mappings()  # an axis mapped twice fails here, before any work

    def axis_mappings(self) -> AxisMappings:
        """The parameter and compute mappings from the basic and advanced fields."""
        return make_axis_mappings(
            batch_axis=self.batch_axis,
            fsdp_axis=self.fsdp_axis,
            tensor_parallel_axes=self.tensor_parallel_axes,
            axis_resources=self.axis_resources,
            parameter_axis_resources=self.parameter_axis_resources,
            compute_axis_resources=self.compute_axis_resources,
        )

    @property
    def policy(self) -> jmp.Policy:
        return jmp.get_policy(self.mp)

    def microbatches(self, num_devices: int) -> int:
        """Microbatches per step implied by the batch and ``per_device_parallelism``.

        ``num_devices`` is the data-parallel size (replica x data): the devices the batch is split over.
        """
        if self.train_batch_size % num_devices:
            raise ValueError(
                f"trainer.train_batch_size ({self.train_batch_size}) must be divisible by the data-parallel "
                f"size {num_devices} (trainer.mesh replica x data)"
            )
        per_device = self.train_batch_size // num_devices
        if self.per_device_parallelism == -1 or self.per_device_parallelism >= per_device:
            return 1
        if per_device % self.per_device_parallelism:
            raise ValueError(
                f"trainer.per_device_parallelism ({self.per_device_parallelism}) must divide the batch per device "
                f"({per_device} = train_batch_size {self.train_batch_size} / {num_devices} devices)"
            )
        return per_device // self.per_device_parallelism


class Trainer:
    """Runs ``train_step`` in a loop with hooks.

    ``loss_fn(model, batch, *, key) -> (loss_sum, weight)`` defines the objective;
    ``optimizer`` is any optax transformation. Hooks are added with ``add_hook`` (also as
    a decorator) and run on the host, in registration order, after the steps they are due.

    The state lives on ``trainer.mesh`` (from ``config.mesh``, over ``devices`` or all of
    them), laid out by the parameter mapping; the step computes under the compute mapping.
    """

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        lr_schedule: optax.Schedule | None = None,
        run_dir: str | Path | None = None,
        devices: Sequence[jax.Device] | None = None,
    ):
        config.distributed.initialize()  # before anything touches the devices
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_schedule = lr_schedule
        self.run_id = config.run_id or time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or config.run_dir or Path("runs") / self.run_id)
        self.mesh = config.mesh.build(devices)
        self.mappings = config.axis_mappings()
        self.num_microbatches = config.microbatches(data_parallel_size(self.mesh))
        self.hooks: list[Hook] = []
        self.jit_hooks: list[JitHook] = []
        self._tracker: Tracker | None = None
        self._step_fn: Callable | None = None

    # ------------------------------------------------------------------ hooks
    def add_hook(self, fn: Callable[[StepInfo], Any] | Hook | None = None, *, every: int = 1):
        """Run ``fn(info)`` after every ``every``-th step; usable as ``@trainer.add_hook(every=N)``.

        ``fn`` may also be a ``Hook`` (keeps its own ``every``) or a ``JitHook``.
        """
        if fn is None:
            return lambda f: self.add_hook(f, every=every)
        if isinstance(fn, JitHook):
            if self._step_fn is not None:
                raise RuntimeError("JitHooks must be added before the first call to train()")
            self.jit_hooks.append(fn)
        elif isinstance(fn, Hook):
            self.hooks.append(fn)
        else:
            self.hooks.append(FnHook(fn, every))
        return fn

    @property
    def tracker(self) -> Tracker:
        """The run's tracker (created on first use, in the run directory)."""
        if self._tracker is None:
            self._tracker = build_tracker(self.config.tracker, self.run_dir)
        return self._tracker

    # ------------------------------------------------------------------ state
    def initial_state(self, init_model: Callable[[jax.Array], eqx.Module]) -> TrainerState:
        """A fresh state: the model from ``init_model(key)``, optimizer state, step 0.

        Created inside a jit whose outputs are already sharded by the parameter mapping,
        so the whole model never exists on one device or host.
        """

        def init(key):
            model_key, train_key = jax.random.split(key)
            model = self.config.policy.cast_to_param(init_model(model_key))
            opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
            return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, train_key)

        key = jax.random.PRNGKey(self.config.seed)
        with self.mesh_context():
            shardings = self.state_shardings(jax.eval_shape(init, key))
            return jax.jit(init, out_shardings=shardings)(key)

    def state_shardings(self, state: Any) -> Any:
        """Shardings of a state (or its shapes) under the parameter mapping."""
        return hax.partitioning.infer_resource_partitions(
            state, self.mappings.parameter, preserve_existing_shardings=False, mesh=self.mesh
        )

    def mesh_context(self) -> contextlib.ExitStack:
        """Enter the mesh and the compute mapping (what tracing a sharded function needs)."""
        stack = contextlib.ExitStack()
        stack.enter_context(hax.partitioning.set_mesh(self.mesh))
        stack.enter_context(hax.axis_mapping(self.mappings.compute))
        return stack

    def shard_batch(self, local_batch: Any) -> Any:
        """A global batch array from this process's rows, split over (replica, data)."""

        def to_global(x):
            x = np.asarray(x)
            sharding = batch_sharding(self.mesh, x.ndim)
            global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            return jax.make_array_from_process_local_data(sharding, x, global_shape)

        return jax.tree.map(to_global, local_batch)

    def mesh_jit(self, fn: Callable, **jit_kwargs) -> Callable:
        """``jax.jit(fn)``, traced and run inside ``mesh_context``."""
        jitted = jax.jit(fn, **jit_kwargs)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.mesh_context():
                return jitted(*args, **kwargs)

        call.jitted = jitted  # for .lower() and cache inspection
        return call

    def _build_step(self, state: TrainerState) -> Callable:
        if self._step_fn is None:
            step = make_train_step(
                self.loss_fn,
                self.optimizer,
                mp=self.config.policy,
                num_microbatches=self.num_microbatches,
                lr_schedule=self.lr_schedule,
                jit_hooks=self.jit_hooks,
            )
            shardings = self.state_shardings(state)
            self._step_fn = self.mesh_jit(
                step, out_shardings=(shardings, replicated(self.mesh)), donate_argnums=0
            )
        return self._step_fn

    def train_step(
        self, state: TrainerState, batch: Any
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        """Run the jitted pure step (compiled on first use); ``state`` is donated.

        ``batch`` is this process's rows (numpy) or an already global ``jax.Array``.
        """
        step_fn = self._build_step(state)
        if not isinstance(batch, jax.Array):
            batch = self.shard_batch(batch)
        return step_fn(state, batch)

    def compiled_step(self, state: TrainerState, batch: Any):
        """The step compiled ahead of time for these shapes; call it with ``shard_batch(batch)``."""
        step_fn = self._build_step(state)
        with self.mesh_context():
            return step_fn.jitted.lower(state, self.shard_batch(batch)).compile()

    # ------------------------------------------------------------------ loop
    def train(self, state: TrainerState, batches: Iterator[Any] | Sequence[Any]) -> StepInfo:
        """Train from ``state`` to ``num_train_steps`` on ``batches``; returns the final ``StepInfo``.

        Step k+1 is dispatched before the host waits for step k, so the device never idles
        on the host; only hooks that read this step's values (at their intervals) wait.
        """
        batches = iter(batches)
        start_step = int(state.step)
        info = StepInfo(step=start_step, state=state, metrics={})
        for hook in self.hooks:
            hook.on_train_begin(info)

        previous, pending = None, None
        last_done = started = time.perf_counter()
        limit = self.config.max_train_time
        try:
            for step in range(start_step + 1, self.config.num_train_steps + 1):
                batch = next(batches)
                dispatched_at = time.perf_counter()
                state, metrics = self.train_step(state, batch)
                if pending is not None:
                    previous, last_done = self._complete(pending, last_done)
                self._flush(info)  # the record of the step before, now that this one is queued
                info = StepInfo(
                    step, state, metrics, previous=previous, dispatched_at=dispatched_at
                )
                for hook in self.hooks:
                    if step % hook.every == 0:
                        hook.on_step(info)
                pending = (step, metrics)
                if limit is not None and time.perf_counter() - started > limit.total_seconds():
                    logger.warning(
                        "stopping at step %d: trainer.max_train_time (%s) reached", step, limit
                    )
                    break
            if pending is not None:
                info.previous, _ = self._complete(pending, last_done)
            for hook in self.hooks:
                hook.on_train_end(info)
        finally:
            self._flush(info)
        return info

    def _complete(self, pending, last_done: float) -> tuple[CompletedStep, float]:
        step, metrics = pending
        host = {k: v.item() for k, v in jax.device_get(metrics).items() if v.size == 1}
        now = time.perf_counter()
        return CompletedStep(step, host, now - last_done, now), now

    def _flush(self, info: StepInfo) -> None:
        if info.record:
            self.tracker.log(dict(info.record), step=info.step)
            info.record.clear()

    def finish(self) -> None:
        """Close the tracker."""
        if self._tracker is not None:
            self._tracker.finish()
