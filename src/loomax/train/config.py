"""``TrainerConfig``: the ``trainer`` section of a run (loop, batch, precision, mesh, hooks...)."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import jmp

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.checkpoint import CheckpointerConfig
from loomax.config import ConfigError
from loomax.distributed import DistributedConfig, RayConfig
from loomax.jax_setup import check_jax_options
from loomax.mesh import AxisMappings, MeshConfig, make_axis_mappings
from loomax.models.axes import Layers
from loomax.stages import PipelineConfig
from loomax.tracking import JsonlTrackerConfig, NoopTrackerConfig, TrackerConfig
from loomax.train.averaging import ModelAveragingConfig
from loomax.train.diloco import WORKERS, DiLoCoConfig
from loomax.train.hook_config import HookConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` section: loop length, batch, precision, logging and eval cadence."""

    seed: int = 0
    """Seed of model initialisation, data order and every other random choice."""
    num_train_steps: int = 1000
    """Optimizer steps to take."""
    num_train_epochs: float | None = None
    """Train for this many passes over the training data instead (sets num_train_steps; may be fractional); null = num_train_steps."""
    train_batch_size: int | list[BatchStage] = 32
    """Sequences per optimizer step, over all devices: an int, or stages [{start: 0, value: 256}, {start: 1000, value: 512}]."""
    allow_nondivisible_batch_size: bool = False
    """Let train_batch_size not divide over the data-parallel devices (one process only): such a batch is placed whole on every device, its compute split unevenly."""
    per_device_parallelism: int = -1
    """Sequences per device per forward/backward; smaller than the batch per device means gradient accumulation. -1 = the whole batch."""
    mp: str = "f32"
    """jmp precision policy, e.g. f32 or p=f32,c=bfloat16 (params, compute, output)."""
    run_id: str | None = None
    """Name of the run; null = the one run_dir records (a rerun continues it), else a timestamp."""
    run_dir: str | None = None
    """Where the run writes its files; null = runs/<run_id>."""
    log_every: int = 10
    """Send metrics to the tracker every this many steps (and at the last step)."""
    log_dir: str | None = None
    """Also write each process's Python log to <log_dir>/<run_id>.process-<i>.log; null = no file."""
    steps_per_eval: int = 1000
    """Evaluate on the validation data every this many steps (and at the last step)."""
    eval_steps: list[int] = field(default_factory=list)
    """Also evaluate at these steps, e.g. [100, 500] (besides every steps_per_eval)."""
    max_eval_batches: int | None = 10
    """Evaluate on at most this many validation batches (of each set); null = all of them."""
    max_eval_tokens: int | None = None
    """Evaluate on at most this many tokens of each validation set (whole batches, at least one); null = no limit."""
    eval_batch_size: int | None = None
    """Sequences per eval batch; null = train_batch_size."""
    per_device_eval_parallelism: int = -1
    """Sequences per device per eval forward pass; smaller than the eval batch per device splits it into microbatches. -1 = the whole batch."""
    eval_at_start: bool = True
    """Also evaluate before the first step."""
    eval_only: bool = False
    """Evaluate the restored (or initial) state once, log it and end without training steps or checkpoints."""
    crash_on_nan: bool = True
    """Stop with an error as soon as the training loss is NaN or infinite."""
    progress_bar: bool = True
    """Show a tqdm progress bar with loss and tokens/s."""
    max_train_time: timedelta | None = None
    """Stop cleanly (final eval and log) after this much wall time, e.g. 4m or 2h; null = no limit."""
    check_memory: bool = True
    """Before the first step, compare the compiled step's memory (XLA's analysis) with the host's available RAM (CPU) or each device's, and stop in one line if it will not fit; false = try anyway."""
    require_accelerator: bool = False
    """Fail at start, before any work, when JAX finds no GPU or TPU (only CPUs)."""
    shutdown_at_exit: timedelta | None = None
    """Power this machine off (a cloud VM: `sudo shutdown -h`) this long after the run ends, however it ends, e.g. 5m; null = never."""
    model_averaging: ModelAveragingConfig | None = None
    """Keep an average of the weights in the state and evaluate it: {type: ema, beta: 0.999} or {type: ema_decay_sqrt, beta, switch_step, decay_steps}; null = none."""
    device_peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; null = known table or, on CPU, a matmul probe."""
    hooks: list[HookConfig] = field(default_factory=list)
    """Extra hooks by `type` with their settings, e.g. [{type: divergence, patience: 3}] (docs/hooks.md)."""
    tracker: TrackerConfig | list[TrackerConfig] = field(default_factory=JsonlTrackerConfig)
    """Where metrics go: one tracker config (type: jsonl, wandb, tensorboard, noop) or a list of them."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh sizes: replica, data, expert, context, model, stage (one may be -1 to fill the devices), or {auto: true} to have loomax train choose."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline parallelism over mesh.stage: the schedule, its microbatches, layer chunks per device."""
    force_strategy: str | None = None
    """Train with this one of loomax plan's strategies (e.g. zero2 8x1, fsdp tp2 4x2) instead of trainer.mesh and its mappings; null = as configured."""
    batch_axis: str = "batch"
    """Logical axis split over the data-parallel mesh axes (replica, data)."""
    fsdp_axis: str | list[str] | None = "embed"
    """Logical axis (or axes) of parameters and optimizer state split over `data` (FSDP); null = replicate."""
    shard_params: bool = True
    """Split parameters by fsdp_axis too (FSDP); false = keep them whole on every device, split only gradients and optimizer state (ZeRO-2)."""
    offload_optimizer_state: bool = False
    """Keep the optimizer state in pinned host memory between steps, moved to the devices only for the update (frees its device memory)."""
    offload_optimizer_update: bool = False
    """With offload_optimizer_state: run the optimizer update on the host too, so the state never enters device memory (gradients go out, updates come back)."""
    offload_params: bool = False
    """Keep the stacked layers' parameters in pinned host memory, fetched to the devices one layer at a time in the forward and backward passes (updated on the host with offload_optimizer_update)."""
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
    freeze: list[str] = field(default_factory=list)
    """Frozen parameters: regexes (re.search) on dotted names, e.g. token_embeddings; no gradient, no optimizer state."""
    checkpoint_frozen: bool = True
    """Write frozen parameters into checkpoints; false = leave them out (a resume takes them from where the run began)."""
    diloco: DiLoCoConfig | None = None
    """DiLoCo: each mesh.replica group trains alone for inner_steps, then an outer step syncs them, e.g. {inner_steps: 100}; null = ordinary training."""

    def __post_init__(self):
        check_jax_options(self.jax_config)
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"trainer.freeze: bad regex {pattern!r} ({e})") from e
        if self.initialize_from is not None and self.initialize_from_hf is not None:
            raise ValueError("set trainer.initialize_from or trainer.initialize_from_hf, not both")
        if self.num_train_epochs is not None and not self.num_train_epochs > 0:
            raise ValueError(
                f"trainer.num_train_epochs must be > 0 or null, got {self.num_train_epochs}"
            )
        if self.shutdown_at_exit is not None and self.shutdown_at_exit.total_seconds() < 0:
            raise ValueError(f"trainer.shutdown_at_exit must be >= 0, got {self.shutdown_at_exit}")
        if self.model_averaging is not None and any(h.type_name() == "ema" for h in self.hooks):
            raise ValueError(
                "trainer.model_averaging: trainer.hooks has an ema hook too; keep one of them"
            )
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
        if self.max_eval_tokens is not None and self.max_eval_tokens <= 0:
            raise ValueError(
                f"trainer.max_eval_tokens must be > 0 or null, got {self.max_eval_tokens}"
            )
        if any(not isinstance(s, int) or s < 1 for s in self.eval_steps):
            raise ValueError(f"trainer.eval_steps must be steps >= 1, got {self.eval_steps}")
        if self.per_device_eval_parallelism == 0 or self.per_device_eval_parallelism < -1:
            raise ValueError(
                "trainer.per_device_eval_parallelism must be > 0 or -1, "
                f"got {self.per_device_eval_parallelism}"
            )
        if self.eval_batch_size is not None and self.eval_batch_size <= 0:
            raise ValueError(
                f"trainer.eval_batch_size must be > 0 or null, got {self.eval_batch_size}"
            )
        try:
            jmp.get_policy(self.mp)
        except (ValueError, KeyError) as e:
            raise ValueError(f"trainer.mp: cannot parse precision policy {self.mp!r} ({e})") from e
        if self.offload_optimizer_state and self.diloco is not None:
            raise ValueError(
                "trainer.offload_optimizer_state: not with trainer.diloco (whose optimizer "
                "state holds every worker's parameters); set one of them"
            )
        if self.offload_params and self.diloco is not None:
            raise ValueError(
                "trainer.offload_params: not with trainer.diloco (whose workers keep their own "
                "parameters on the devices); set one of them"
            )
        if self.offload_optimizer_update and not self.offload_optimizer_state:
            raise ValueError(
                "trainer.offload_optimizer_update: needs trainer.offload_optimizer_state: true "
                "(the update runs where the state rests)"
            )
        if self.diloco is not None and self.num_train_steps % self.diloco.inner_steps:
            logger.warning(
                "trainer.num_train_steps (%d) is not a multiple of trainer.diloco.inner_steps "
                "(%d): the model saved and evaluated at the end is each fragment's last sync, "
                "without the workers' steps since",
                self.num_train_steps,
                self.diloco.inner_steps,
            )
        self.axis_mappings()  # an axis mapped twice fails here, before any work
        _ = self.batch_schedule  # a bad batch-size schedule fails here too

    def axis_mappings(self) -> AxisMappings:
        """The parameter, compute and optimizer mappings from the basic and advanced fields;
        under DiLoCo the workers' copies (``diloco_workers``) rest on ``replica``."""
        mappings = make_axis_mappings(
            batch_axis=self.batch_axis,
            fsdp_axis=self.fsdp_axis,
            tensor_parallel_axes=self.tensor_parallel_axes,
            axis_resources=self.axis_resources,
            parameter_axis_resources=self.parameter_axis_resources,
            compute_axis_resources=self.compute_axis_resources,
            shard_params=self.shard_params,
            layer_axis=Layers if self.mesh.stage > 1 else None,
        )
        if self.diloco is None:
            return mappings
        compute = {k: v for k, v in mappings.compute.items() if k != self.batch_axis}
        for label, mapping in (("parameter", mappings.optimizer), ("compute", compute)):
            for name, target in mapping.items():
                if "replica" in (target if isinstance(target, tuple) else (target,)):
                    raise ValueError(
                        f"trainer.diloco: the {label} mapping sends {name!r} to replica, whose "
                        "groups are the workers (they share nothing but syncs); map it to data or model"
                    )
        workers = {WORKERS: "replica"}
        return AxisMappings(
            {**mappings.parameter, **workers},
            mappings.compute,
            {**mappings.optimizer, **workers},
        )

    def with_epoch_size(self, epoch_size: int | None) -> TrainerConfig:
        """This config with ``num_train_steps`` from ``num_train_epochs`` (epochs of
        ``epoch_size`` sequences); itself when no epochs are asked for."""
        if self.num_train_epochs is None:
            return self
        if not epoch_size:
            raise ConfigError(
                "trainer.num_train_epochs needs the size of an epoch (Trainer(epoch_size=...)); "
                "set trainer.num_train_steps instead"
            )
        from loomax.train.epochs import Epochs

        steps = Epochs(epoch_size, self.batch_schedule).steps_for(self.num_train_epochs)
        return dataclasses.replace(self, num_train_steps=steps)

    def for_scratch_run(self, directory: str) -> TrainerConfig:
        """This config for a throwaway run in ``directory`` (``loomax compile``, ``loomax bench``):
        no tracker, progress bar or checkpoint loading; any checkpoint lands in it."""
        return dataclasses.replace(
            self,
            tracker=NoopTrackerConfig(),
            progress_bar=False,
            run_dir=directory,
            load_checkpoint=False,
            checkpointer=dataclasses.replace(
                self.checkpointer, base_path=f"{directory}/checkpoints"
            ),
        )

    def run_path(self, run_id: str, run_dir: str | Path | None = None) -> Path:
        """The run directory: ``run_dir``, else ``trainer.run_dir``, else ``runs/<run_id>``."""
        return Path(run_dir or self.run_dir or Path("runs") / run_id)

    def checkpoint_path(self, run_id: str, run_dir: str | Path | None = None) -> str:
        """Where the run's checkpoints go: ``checkpointer.base_path``, else ``<run dir>/checkpoints``."""
        return self.checkpointer.base_path or str(self.run_path(run_id, run_dir) / "checkpoints")

    @property
    def policy(self) -> jmp.Policy:
        return jmp.get_policy(self.mp)

    @property
    def batch_schedule(self) -> BatchSchedule:
        """``train_batch_size`` as a schedule: batch size and data offset of every step."""
        return BatchSchedule(self.train_batch_size)

    def eval_microbatch_rows(self, num_devices: int) -> int | None:
        """Rows of one eval microbatch over ``num_devices`` data-parallel devices; None = unsplit."""
        if self.per_device_eval_parallelism == -1:
            return None
        return self.per_device_eval_parallelism * num_devices

    def max_eval_batches_of(self, batch_size: int, seq_len: int) -> int | None:
        """Eval batches per validation set under ``max_eval_batches`` and ``max_eval_tokens``."""
        limits = [self.max_eval_batches] if self.max_eval_batches is not None else []
        if self.max_eval_tokens is not None:
            limits.append(max(1, self.max_eval_tokens // (batch_size * seq_len)))
        return min(limits) if limits else None

    def microbatches(self, num_devices: int, batch_size: int | None = None) -> int:
        """Microbatches per step implied by the batch and ``per_device_parallelism``.

        ``num_devices`` is the data-parallel size (replica x data x expert): the devices the batch is
        split over; ``batch_size`` defaults to the first (or only) batch size.
        """
        batch = batch_size or self.batch_schedule.sizes[0]
        if batch % num_devices and self.allow_nondivisible_batch_size:
            if self.per_device_parallelism != -1:
                raise ConfigError(
                    f"trainer.per_device_parallelism must be -1 when trainer.train_batch_size ({batch}) "
                    f"does not divide over the {num_devices} data-parallel devices "
                    "(trainer.allow_nondivisible_batch_size)"
                )
            return 1
        if batch % num_devices:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be divisible by the data-parallel "
                f"size {num_devices} (trainer.mesh replica x data x expert), or set "
                "trainer.allow_nondivisible_batch_size"
            )
        per_device = batch // num_devices
        if self.per_device_parallelism == -1 or self.per_device_parallelism >= per_device:
            return 1
        if per_device % self.per_device_parallelism:
            raise ConfigError(
                f"trainer.per_device_parallelism ({self.per_device_parallelism}) must divide the batch per device "
                f"({per_device} = train_batch_size {batch} / {num_devices} devices)"
            )
        return per_device // self.per_device_parallelism
