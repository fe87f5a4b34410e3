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

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.checkpoint import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    load_latest,
)
from loomax.distributed import DistributedConfig, RayConfig, broadcast_str
from loomax.jax_setup import apply_jax_settings, check_jax_options
from loomax.mesh import (
    AxisMappings,
    MeshConfig,
    batch_sharding,
    data_parallel_size,
    make_axis_mappings,
    replicate_indivisible,
    replicated,
)
from loomax.storage import to_url
from loomax.tracking import JsonlTrackerConfig, Tracker, TrackerConfig, build_tracker
from loomax.tracking.artifacts import write_file
from loomax.train.control import Control, StepAgreement, StopSignals
from loomax.train.hook_config import HookConfig
from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo, hook_state_keys
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, LossFn, StateExtra, make_train_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` section: loop length, batch, precision, logging and eval cadence."""

    seed: int = 0
    """Seed of model initialisation, data order and every other random choice."""
    num_train_steps: int = 1000
    """Optimizer steps to take."""
    train_batch_size: int | list[BatchStage] = 32
    """Sequences per optimizer step, over all devices: an int, or stages [{start: 0, value: 256}, {start: 1000, value: 512}]."""
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
    hooks: list[HookConfig] = field(default_factory=list)
    """Extra hooks by `type` with their settings, e.g. [{type: divergence, patience: 3}] (docs/hooks.md)."""
    tracker: TrackerConfig | list[TrackerConfig] = field(default_factory=JsonlTrackerConfig)
    """Where metrics go: one tracker config (type: jsonl, wandb, tensorboard, noop) or a list of them."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh sizes: replica, data, model (one may be -1 to fill the devices)."""
    batch_axis: str = "batch"
    """Logical axis split over the data-parallel mesh axes (replica, data)."""
    fsdp_axis: str | list[str] | None = "embed"
    """Logical axis (or axes) of parameters and optimizer state split over `data` (FSDP); null = replicate."""
    tensor_parallel_axes: list[str] = field(default_factory=lambda: ["mlp", "heads", "kv_heads"])
    """Logical axes split over `model` (tensor parallelism; only matters when mesh.model > 1)."""
    axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: logical axis -> mesh axis (or list) for both mappings, applied after the basic fields."""
    parameter_axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: overrides for the parameter mapping only (how params and optimizer state rest)."""
    compute_axis_resources: dict[str, str | list[str] | None] = field(default_factory=dict)
    """Advanced: overrides for the compute mapping only (how activations are laid out)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process settings (jax.distributed); auto-detected on SLURM and TPU pods."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster that builds the token cache: join `address`, or start a local one."""
    checkpointer: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    """Where and when checkpoints are saved (base_path, save_interval, keep)."""
    load_checkpoint: bool | None = None
    """Resume from a checkpoint: null = if one exists, true = one must exist, false = never."""
    load_checkpoint_path: str | None = None
    """A checkpoint, or a directory of them (the latest complete wins), to resume from; null = checkpointer.base_path."""
    initialize_from: str | None = None
    """Start from the model weights of this checkpoint (or directory of them), with a fresh optimizer at step 0."""
    initialize_from_hf: str | None = None
    """Start from the weights of a Hugging Face checkpoint directory (config.json + safetensors), fresh optimizer."""
    allow_partial_checkpoint: bool = False
    """Let a checkpoint lack some arrays of the state; those keep their fresh initial values."""
    jax_compilation_cache_dir: str | None = None
    """JAX persistent compilation cache (a path or gs:// URL); null = JAX_COMPILATION_CACHE_DIR or none."""
    jax_config: dict[str, Any] = field(default_factory=dict)
    """JAX options set at start, by name, e.g. {jax_debug_nans: true}."""

    def __post_init__(self):
        check_jax_options(self.jax_config)
        if self.initialize_from is not None and self.initialize_from_hf is not None:
            raise ValueError("set trainer.initialize_from or trainer.initialize_from_hf, not both")
        positive = ("num_train_steps", "log_every", "steps_per_eval")
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
        _ = self.batch_schedule  # a bad batch-size schedule fails here too

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

    @property
    def batch_schedule(self) -> BatchSchedule:
        """``train_batch_size`` as a schedule: batch size and data offset of every step."""
        return BatchSchedule(self.train_batch_size)

    def microbatches(self, num_devices: int, batch_size: int | None = None) -> int:
        """Microbatches per step implied by the batch and ``per_device_parallelism``.

        ``num_devices`` is the data-parallel size (replica x data): the devices the batch is
        split over; ``batch_size`` defaults to the first (or only) batch size.
        """
        batch = batch_size or self.batch_schedule.sizes[0]
        if batch % num_devices:
            raise ValueError(
                f"trainer.train_batch_size ({batch}) must be divisible by the data-parallel "
                f"size {num_devices} (trainer.mesh replica x data)"
            )
        per_device = batch // num_devices
        if self.per_device_parallelism == -1 or self.per_device_parallelism >= per_device:
            return 1
        if per_device % self.per_device_parallelism:
            raise ValueError(
                f"trainer.per_device_parallelism ({self.per_device_parallelism}) must divide the batch per device "
                f"({per_device} = train_batch_size {batch} / {num_devices} devices)"
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
        apply_jax_settings(config.jax_compilation_cache_dir, config.jax_config)
        config.distributed.initialize()  # before anything touches the devices
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_schedule = lr_schedule
        # every process must name the run alike: process 0's clock decides
        self.run_id = config.run_id or broadcast_str("run_id", time.strftime("%Y%m%d-%H%M%S"))
        self.run_dir = Path(run_dir or config.run_dir or Path("runs") / self.run_id)
        self.mesh = config.mesh.build(devices)
        self.mappings = config.axis_mappings()
        self.num_microbatches = config.microbatches(data_parallel_size(self.mesh))
        self.batch_schedule = config.batch_schedule
        for size in self.batch_schedule.sizes:  # every stage must split over the devices
            config.microbatches(data_parallel_size(self.mesh), size)
        self.hooks: list[Hook] = []
        self.jit_hooks: list[JitHook] = []
        self.extras: dict[str, StateExtra] = {}
        """Arrays hooks keep in ``TrainerState.extras``, by name."""
        self.eval_weights: str | None = None
        """The ``extras`` entry evaluators use instead of the model weights (EMA), if any."""
        self._state_made = False
        self._sharding_notes: set[str] = set()
        self._tracker: Tracker | None = None
        self._step_fns: dict[int, Callable] = {}
        """The jitted step per number of microbatches (each batch size may need its own)."""
        base_path = config.checkpointer.base_path or str(self.run_dir / "checkpoints")
        self.checkpointer = Checkpointer(config.checkpointer, base_path)
        self.checkpointer.check_writable()  # a clear error now, not at the first save
        self.run_config: dict[str, Any] | None = None
        """The whole run's config (JSON), stored in each checkpoint's metadata."""
        self.restored_from: CheckpointInfo | None = None
        """The checkpoint ``initial_state`` resumed from, if any."""
        self.stop_reason: str | None = None
        """Why ``train`` stopped before ``num_train_steps`` (a signal, the time limit), if it did."""
        self._restored_hook_states: dict[str, Any] = {}
        self._train_seconds = 0.0

    # ------------------------------------------------------------------ hooks
    def add_hook(
        self,
        fn: Callable[[StepInfo], Any] | Hook | JitHook | None = None,
        *,
        every: int = 1,
        priority: int = 0,
    ):
        """Run ``fn(info)`` after every ``every``-th step; usable as ``@trainer.add_hook(every=N)``.

        ``fn`` may also be a ``Hook`` (keeps its own ``every`` and ``priority``) or a
        ``JitHook``. Hooks that change the step (``wrap_optimizer``, ``jit_hooks``,
        ``state_extras``) must be added before ``initial_state``.
        """
        if fn is None:
            return lambda f: self.add_hook(f, every=every, priority=priority)
        if isinstance(fn, JitHook):
            self._before_compile("JitHooks")
            self.jit_hooks.append(fn)
            return fn
        hook = fn if isinstance(fn, Hook) else FnHook(fn, every, priority)
        wrapped, jit_hooks = hook.wrap_optimizer(self.optimizer), hook.jit_hooks()
        extras = hook.state_extras()
        if wrapped is not self.optimizer or extras:
            if self._state_made:
                raise RuntimeError(
                    f"hook {hook.name} changes the optimizer or the state: add it before initial_state()"
                )
            self.optimizer = wrapped
        if jit_hooks:
            self._before_compile(f"hook {hook.name} (it has JitHooks)")
            self.jit_hooks.extend(jit_hooks)
        for name, extra in extras.items():
            if name in self.extras:
                raise ValueError(f"two hooks keep state extras named {name!r}")
            self.extras[name] = extra
        if getattr(hook, "provides_eval_weights", None):
            self.eval_weights = hook.provides_eval_weights
        self.hooks.append(hook)
        self.hooks.sort(key=lambda h: -h.priority)  # stable: registration order among equals
        return fn

    def _before_compile(self, what: str) -> None:
        if self._step_fns:
            raise RuntimeError(f"{what} must be added before the first call to train()")

    @property
    def tracker(self) -> Tracker:
        """The run's tracker (created on first use, in the run directory)."""
        if self._tracker is None:
            self._tracker = build_tracker(self.config.tracker, self.run_dir)
        return self._tracker

    # ------------------------------------------------------------------ state
    def initial_state(
        self,
        init_model: Callable[[jax.Array], eqx.Module],
        *,
        initial_weights: Callable[[], eqx.Module] | None = None,
    ) -> TrainerState:
        """The state to train from: resumed from a checkpoint, or fresh from ``init_model(key)``.

        ``trainer.load_checkpoint`` decides whether a checkpoint is loaded (from
        ``load_checkpoint_path`` or the checkpointer's ``base_path``); without one,
        ``trainer.initialize_from`` may supply the model weights, or else
        ``initial_weights()`` (e.g. a Hugging Face checkpoint's, called only when the run
        does not resume), each with a fresh optimizer at step 0. A fresh state is made
        inside a jit whose outputs are already sharded by the parameter mapping, so the
        whole model never exists on one device or host; loaded arrays are read straight
        into that sharding, whatever the mesh that saved them.
        """

        def init(key):
            model_key, train_key = jax.random.split(key)
            model = self.config.policy.cast_to_param(init_model(model_key))
            params = eqx.filter(model, eqx.is_inexact_array)
            opt_state = self.optimizer.init(params)
            extras = {name: extra.init(params) for name, extra in self.extras.items()}
            return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, train_key, extras)

        self._state_made = True
        key = jax.random.PRNGKey(self.config.seed)
        with self.mesh_context():
            shapes = jax.eval_shape(init, key)
            shardings = self.state_shardings(shapes)
            fresh = functools.partial(jax.jit(init, out_shardings=shardings), key)
            resumed = self._resume(shapes, shardings, fresh)
            if resumed is not None:
                return resumed
            if self.config.initialize_from is not None:
                return self._initialize_from(shapes, shardings, fresh)
            if initial_weights is not None:
                model = self.config.policy.cast_to_param(initial_weights())
                return self._start_from(fresh(), model, shardings)
            return fresh()

    def _resume(self, shapes, shardings, fresh: Callable[[], TrainerState]):
        config = self.config
        own = self.checkpointer.directory.url
        self.checkpointer.adopt(list_checkpoints(own), None)
        if config.load_checkpoint is False:
            return None
        path = config.load_checkpoint_path or own
        found = load_latest(path, shapes, shardings, fall_back=config.load_checkpoint is None)
        if found is None:
            if config.load_checkpoint:
                raise FileNotFoundError(
                    f"trainer.load_checkpoint is true but there is no complete checkpoint at {path}"
                )
            if config.load_checkpoint_path:
                logger.warning("no complete checkpoint at %s: starting fresh", path)
            return None
        checkpoint, state, missing = found
        state = self._fill_missing(checkpoint, state, missing, fresh)
        logger.info("resumed from %s (step %d)", checkpoint, checkpoint.step)
        self.restored_from = checkpoint
        self._restored_hook_states = checkpoint.metadata.get("hooks", {})
        self._train_seconds = float(checkpoint.metadata.get("train_seconds", 0.0))
        if to_url(path) == own or checkpoint.directory.url.startswith(own + "/"):
            self.checkpointer.adopt([], checkpoint.step)  # this step is already on disk
        return state

    def _initialize_from(self, shapes, shardings, fresh: Callable[[], TrainerState]):
        path = self.config.initialize_from
        found = load_latest(path, shapes, shardings, fall_back=False, prefix="model")
        if found is None:
            raise FileNotFoundError(f"trainer.initialize_from: no complete checkpoint at {path}")
        checkpoint, loaded, missing = found
        state = fresh()
        model = self._fill_missing(checkpoint, loaded.model, missing, lambda: state.model)
        logger.info(
            "model weights from %s (step %d); optimizer fresh at step 0",
            checkpoint,
            checkpoint.step,
        )
        return self._start_from(state, model, shardings)

    def _start_from(self, state: TrainerState, model: eqx.Module, shardings) -> TrainerState:
        """``state`` with ``model`` as its weights (placed by the parameter mapping), and the
        optimizer state and the hooks' extras (e.g. EMA weights) made anew from them."""

        def place_and_derive(m):
            params = eqx.filter(m, eqx.is_inexact_array)
            extras = {name: extra.init(params) for name, extra in self.extras.items()}
            return m, self.optimizer.init(params), extras

        out = (shardings.model, shardings.opt_state, shardings.extras)
        with self.mesh_context():
            model, opt_state, extras = jax.jit(place_and_derive, out_shardings=out)(model)
        return TrainerState(state.step, model, opt_state, state.key, extras)

    def _fill_missing(self, checkpoint: CheckpointInfo, tree, missing: list[str], fresh):
        if not missing:
            return tree
        if not self.config.allow_partial_checkpoint:
            raise CheckpointError(
                f"checkpoint {checkpoint} lacks {len(missing)} array(s) of the state, e.g. "
                f"{', '.join(missing[:3])}; set trainer.allow_partial_checkpoint: true to start those fresh"
            )
        logger.warning(
            "checkpoint %s lacks %d array(s) (%s...): they keep their initial values",
            checkpoint,
            len(missing),
            ", ".join(missing[:3]),
        )
        return jax.tree.map(
            lambda a, b: b if a is None else a, tree, fresh(), is_leaf=lambda x: x is None
        )

    def state_shardings(self, state: Any) -> Any:
        """Shardings of a state (or its shapes) under the parameter mapping; an axis whose
        size does not divide over its mesh axes is kept whole (with a warning, once)."""
        shardings = hax.partitioning.infer_resource_partitions(
            state, self.mappings.parameter, preserve_existing_shardings=False, mesh=self.mesh
        )
        shardings, notes = replicate_indivisible(shardings, state)
        for note in notes:
            if note not in self._sharding_notes:
                self._sharding_notes.add(note)
                logger.warning("parameter mapping: %s: kept whole on every device", note)
        return shardings

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

    @property
    def _step_fn(self) -> Callable | None:
        """The step of the first batch size, once compiled."""
        return self._step_fns.get(self.num_microbatches)

    def _build_step(self, state: TrainerState, num_microbatches: int | None = None) -> Callable:
        microbatches = num_microbatches or self.num_microbatches
        if microbatches not in self._step_fns:
            step = make_train_step(
                self.loss_fn,
                self.optimizer,
                mp=self.config.policy,
                num_microbatches=microbatches,
                lr_schedule=self.lr_schedule,
                jit_hooks=self.jit_hooks,
                extras=self.extras,
            )
            shardings = self.state_shardings(state)
            self._step_fns[microbatches] = self.mesh_jit(
                step, out_shardings=(shardings, replicated(self.mesh)), donate_argnums=0
            )
        return self._step_fns[microbatches]

    def train_step(
        self, state: TrainerState, batch: Any, *, num_microbatches: int | None = None
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        """Run the jitted pure step (compiled on first use); ``state`` is donated.

        ``batch`` is this process's rows (numpy) or an already global ``jax.Array``.
        ``num_microbatches`` defaults to that of the first batch size.
        """
        step_fn = self._build_step(state, num_microbatches)
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
        After each step's hooks the trainer acts on what they asked through
        ``info.control`` (eval, then save, then stop), with process 0's decision taken by
        every process. Checkpoints are also saved by the checkpointer's policies and at the
        end; SIGTERM or SIGINT (and ``max_train_time``) stop after the current step.
        """
        batches = iter(batches)
        start_step = int(state.step)
        control = Control()
        info = self._step_info(start_step, state, {}, control)
        self._load_hook_states()
        previous, pending = None, None
        last_done = started = time.perf_counter()
        agreement, signals = StepAgreement(), StopSignals()
        self.stop_reason = None
        try:
            with signals.installed():
                self._call("on_train_begin", info)
                self._act(info, {"eval": control.eval_requested}, started)
                control.clear()
                for step in range(start_step + 1, self.config.num_train_steps + 1):
                    batch = next(batches)
                    for hook in self.hooks:
                        batch = hook.transform_batch(step, batch)
                    dispatched_at = time.perf_counter()
                    state, metrics = self.train_step(state, batch, **self._batch_size_args(step))
                    if pending is not None:
                        previous, last_done = self._complete(pending, last_done)
                    self._flush(info)  # the record of the step before, now that this one is queued
                    info = self._step_info(step, state, metrics, control, previous, dispatched_at)
                    self._call("on_step", info)
                    pending = (step, metrics)
                    proposal = control.proposal()
                    proposal["stop"] = (
                        proposal["stop"]
                        or (f"signal {signals.received}" if signals.received else None)
                        or self._over_time(started)
                    )
                    proposal["save"] = (
                        "permanent" if proposal["save"] else self.checkpointer.due(step)
                    )
                    decision = agreement.agree(step, proposal)
                    control.clear()
                    self._act(info, decision, started)
                    if decision["stop"]:
                        self.stop_reason = decision["stop"]
                        logger.warning("stopping at step %d: %s", step, self.stop_reason)
                        break
                if pending is not None:
                    info.previous, _ = self._complete(pending, last_done)
                self._call("on_train_end", info)
                end = {"eval": control.eval_requested, "save": None}
                if self.config.checkpointer.save_at_end or control.save_requested:
                    permanent = (
                        self.stop_reason is None
                        or control.save_requested
                        or self.config.checkpointer.is_permanent(info.step)
                    )
                    end["save"] = "permanent" if permanent else "temporary"
                control.clear()
                self._act(info, end, started)
                self.checkpointer.wait()
        except BaseException as error:
            for hook in self.hooks:
                try:
                    hook.on_error(info, error)
                except Exception:  # noqa: BLE001 - the original error matters more
                    logger.exception("hook %s failed in on_error", hook.name)
            raise
        finally:
            self._flush(info)
            try:
                self.checkpointer.wait()  # let a save in flight commit, even after an error
            except Exception:  # noqa: BLE001 - the original error matters more
                logger.exception("checkpoint save failed")
        return info

    def _batch_size_args(self, step: int) -> dict[str, int]:
        """``train_step`` arguments for step ``step`` (made from batch ``step - 1``) under a batch-size schedule."""
        if self.batch_schedule.is_constant:
            return {}
        size = self.batch_schedule.size_at(step - 1)
        return {"num_microbatches": self.config.microbatches(data_parallel_size(self.mesh), size)}

    def _step_info(self, step, state, metrics, control, previous=None, dispatched_at=None):
        return StepInfo(
            step,
            state,
            metrics,
            previous=previous,
            dispatched_at=dispatched_at,
            control=control,
            run_dir=self.run_dir,
            eval_weights=self.eval_weights,
        )

    def _call(self, method: str, info: StepInfo, *args: Any) -> None:
        """Run ``method`` of every hook (``on_step`` only where due), naming the running hook."""
        for hook in self.hooks:
            if method == "on_step" and info.step % hook.every:
                continue
            info.control.running = hook.name
            try:
                getattr(hook, method)(info, *args)
            finally:
                info.control.running = None

    def _act(self, info: StepInfo, decision: dict[str, Any], started: float) -> None:
        """Evaluate, then save, as ``decision`` says."""
        if decision.get("eval"):
            results: dict[str, float] = {}
            for hook in self.hooks:
                results.update(hook.run_eval(info) or {})
            if results:
                info.log(results)
                self._call("on_eval", info, results)
        if decision.get("save"):
            self._save(info, started, permanent=decision["save"] == "permanent")

    def _over_time(self, started: float) -> str | None:
        limit = self.config.max_train_time
        if limit is not None and time.perf_counter() - started > limit.total_seconds():
            return f"trainer.max_train_time ({limit}) reached"
        return None

    def _save(self, info: StepInfo, started: float, *, permanent: bool) -> None:
        metadata = {
            "config": self.run_config,
            "data": {"batches_consumed": info.step},
            "rng_key": np.asarray(jax.device_get(info.state.key)).tolist(),
            "hooks": self._hook_states(),
            "train_seconds": self._train_seconds + time.perf_counter() - started,
            "mesh": dict(self.mesh.shape),
        }
        if not self.batch_schedule.is_constant:
            metadata["data"]["sequences_consumed"] = self.batch_schedule.offset(info.step)
        files = {k: v for hook in self.hooks for k, v in hook.checkpoint_files().items()}
        if self.checkpointer.save(
            info.step, info.state, metadata, permanent=permanent, files=files
        ):
            self._call("on_save", info, self.checkpointer.directory.child(f"step-{info.step}").url)

    def _hook_states(self) -> dict[str, Any]:
        return {key: hook.state_dict() for key, hook in hook_state_keys(self.hooks).items()}

    def _load_hook_states(self) -> None:
        saved, self._restored_hook_states = self._restored_hook_states, {}
        if not saved:
            return
        keyed = hook_state_keys(self.hooks)
        for key, value in saved.items():
            if key in keyed:
                keyed[key].load_state_dict(value)
            else:
                logger.warning(
                    "checkpoint has state for hook %r, which this run does not have", key
                )

    def _complete(self, pending, last_done: float) -> tuple[CompletedStep, float]:
        step, metrics = pending
        host = {k: v.item() for k, v in jax.device_get(metrics).items() if v.size == 1}
        now = time.perf_counter()
        return CompletedStep(step, host, now - last_done, now), now

    def _flush(self, info: StepInfo) -> None:
        """Send the step's record to the tracker, after the hooks' ``pre_log``."""
        if not info.record:
            return
        record = dict(info.record)
        info.record.clear()
        for hook in self.hooks:
            hook.pre_log(info, record)
        if record:
            self.tracker.log(record, step=info.step)

    def write_artifact(self, name: str, obj: Any, *, type: str = "artifact") -> Path:
        """Save ``obj`` as ``<run_dir>/artifacts/<name>`` and log it to the tracker (process 0).

        ``str`` and ``bytes`` are written as they are, an existing ``Path`` is copied, anything
        else is written as JSON. Returns the path (on every process).
        """
        path = self.run_dir / "artifacts" / name
        if jax.process_index() == 0:
            write_file(path, obj)
            self.tracker.log_artifact(path, name=name, type=type)
        return path

    def finish(self) -> None:
        """Wait for the checkpoint in flight and close the tracker."""
        self.checkpointer.wait()
        if self._tracker is not None:
            self._tracker.finish()
