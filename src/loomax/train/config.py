"""``TrainerConfig``: the ``trainer`` section of a run (loop, batch, precision, mesh, hooks...)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import jmp

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.checkpoint import CheckpointerConfig
from loomax.config import ConfigError
from loomax.distributed import DistributedConfig, RayConfig
from loomax.jax_setup import check_jax_options
from loomax.mesh import AxisMappings, MeshConfig, make_axis_mappings
from loomax.tracking import JsonlTrackerConfig, TrackerConfig
from loomax.train.hook_config import HookConfig


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
    freeze: list[str] = field(default_factory=list)
    """Frozen parameters: regexes (re.search) on dotted names, e.g. token_embeddings; no gradient, no optimizer state."""
    checkpoint_frozen: bool = True
    """Write frozen parameters into checkpoints; false = leave them out (a resume takes them from where the run began)."""

    def __post_init__(self):
        check_jax_options(self.jax_config)
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"trainer.freeze: bad regex {pattern!r} ({e})") from e
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

        ``num_devices`` is the data-parallel size (replica x data): the devices the batch is
        split over; ``batch_size`` defaults to the first (or only) batch size.
        """
        batch = batch_size or self.batch_schedule.sizes[0]
        if batch % num_devices:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be divisible by the data-parallel "
                f"size {num_devices} (trainer.mesh replica x data)"
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
