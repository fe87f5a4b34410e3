"""The ``optimizer`` section: a choice registry (``optimizer.type``) of optax chains.

Every optimizer is the same chain around its own direction (``direction()``):
clip gradients -> direction (Adam, Lion, Adafactor, Muon) -> clip update RMS -> clip
update norm against its history -> decoupled weight decay on a mask -> scheduled LR,
optionally wrapped in ``skip_bad_steps``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import draccus
import jax.numpy as jnp
import optax

from loomax.batch_schedule import BatchSchedule
from loomax.optim.mask import regex_mask, weight_decay_mask
from loomax.optim.schedule import SCHEDULES, LrSchedule
from loomax.optim.skip_bad_steps import skip_bad_steps
from loomax.optim.transforms import clip_by_global_norm, clip_update_norm, clip_update_rms

LR_BATCH_SCALINGS = ("none", "sqrt", "linear")


@dataclass(frozen=True)
class SkipBadStepsConfig:
    """Skip a step whose loss or gradient norm is above mean + sigma_factor * std of recent steps."""

    rolling_interval_length: int = 100
    """Steps of history the mean and std are taken over."""
    sigma_factor: float = 6.0
    """How many standard deviations above the mean count as a bad step."""
    min_history: int = 10
    """Accepted steps needed before anything is skipped (a NaN/Inf step always is); at most the window."""

    def __post_init__(self):
        if self.rolling_interval_length < 2:
            raise ValueError(
                f"optimizer.skip_bad_steps.rolling_interval_length must be >= 2, got {self.rolling_interval_length}"
            )
        if self.sigma_factor <= 0:
            raise ValueError(
                f"optimizer.skip_bad_steps.sigma_factor must be > 0, got {self.sigma_factor}"
            )
        if self.min_history < 1:
            raise ValueError(
                f"optimizer.skip_bad_steps.min_history must be >= 1, got {self.min_history}"
            )


@dataclass(frozen=True)
class ClipUpdateNormConfig:
    """Clip the update norm to mean + sigma_factor * std of the recent update norms."""

    rolling_interval_length: int = 128
    """Steps of history the mean and std are taken over (nothing is clipped before it is full)."""
    sigma_factor: float = 2.0
    """How many standard deviations above the mean the norm may reach."""


@dataclass(frozen=True)
class OptimizerConfig(draccus.ChoiceRegistry, abc.ABC):
    """Fields shared by every optimizer: learning rate and schedule, decay, clipping, skipping."""

    learning_rate: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay coefficient (multiplied by the learning rate)."""
    adamc_weight_decay: bool = False
    """AdamC: scale weight decay with lr / peak lr, keeping weight_decay / lr constant as the LR decays."""
    weight_decay_modules: list[str] | str | None = None
    """Regex (or list) of parameter names to decay, e.g. 'attn|mlp'; null = the default mask."""
    default_weight_decay_mask: bool = True
    """Without weight_decay_modules: true = decay linear weights only, false = decay every parameter."""
    decay_embeddings: bool = False
    """With the default mask, also decay embedding tables (biases and norms never decay)."""
    lr_schedule: str = "cosine"
    """Shape of each decay: constant, linear, cosine, inv_sqrt or inv."""
    warmup: float = 0.01
    """Linear warmup of the first cycle: a fraction of it if < 1, else a number of steps."""
    decay: float | None = None
    """Decay at the end of each cycle: a fraction of it if < 1, else steps; null = all of it after warmup (no stable phase)."""
    min_lr_ratio: float = 0.1
    """Learning rate at the end of each decay, as a fraction of the peak."""
    timescale: float | None = None
    """inv_sqrt / inv: steps over which the LR falls to 1/sqrt(2) / 1/2 of the peak; null = the warmup length."""
    cycles: list[int] | int | None = None
    """Number of equal cycles, or a list of the steps where cycles end; null = one cycle."""
    cycle_length: list[float] | float | None = None
    """Cycle length (steps, or a fraction of training if < 1), repeated, or a list of lengths; not with cycles."""
    rewarmup: float = 0.0
    """Warmup at the start of every later cycle (from the minimum LR): fraction of the cycle or steps; 0 = jump to the peak."""
    cycle_peaks: list[float] | None = None
    """Peak of each cycle as a multiple of learning_rate (one per cycle, e.g. a stepped peak); null = every cycle at learning_rate."""
    scale_lr_with_batch: str = "none"
    """When the batch size changes (a trainer.train_batch_size schedule): none, sqrt (lr x sqrt(new/old)) or linear."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global norm; null disables clipping."""
    update_rms_clipping: float | None = None
    """Clip each parameter's update (before LR and decay) to this root-mean-square; null = off."""
    clip_update_norm: ClipUpdateNormConfig | None = None
    """Clip the update norm against the history of update norms; null = off."""
    skip_bad_steps: SkipBadStepsConfig | bool | int = False
    """Skip steps whose loss or grad norm spikes: true, a window length, or {rolling_interval_length, sigma_factor, min_history}."""
    qk_clip_tau: float | None = None
    """QK-clip (Kimi K2's MuonClip, any optimizer): after each step, rescale the query/key projections of every attention head whose largest pre-softmax logit on the step's batch passed this (Kimi K2: 100), logged as optim/max_logit; null = off. Needs attn_backend vanilla or blockwise (auto picks them)."""

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(
                f"optimizer.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                f"optimizer.max_grad_norm must be > 0 or null, got {self.max_grad_norm}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if self.cycles is not None and self.cycle_length is not None:
            raise ValueError(
                "optimizer.cycles and optimizer.cycle_length: give one of them, not both"
            )
        if self.scale_lr_with_batch not in LR_BATCH_SCALINGS:
            raise ValueError(
                f"optimizer.scale_lr_with_batch must be one of {LR_BATCH_SCALINGS}, got {self.scale_lr_with_batch!r}"
            )
        if self.update_rms_clipping is not None and self.update_rms_clipping <= 0:
            raise ValueError(
                f"optimizer.update_rms_clipping must be > 0 or null, got {self.update_rms_clipping}"
            )
        if self.qk_clip_tau is not None and self.qk_clip_tau <= 0:
            raise ValueError(f"optimizer.qk_clip_tau must be > 0 or null, got {self.qk_clip_tau}")
        if self.timescale is not None and self.timescale <= 0:
            raise ValueError(f"optimizer.timescale must be > 0 or null, got {self.timescale}")
        for name in ("warmup", "rewarmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"optimizer.{name} must be >= 0, got {getattr(self, name)}")
        if self.decay is not None and self.decay < 0:
            raise ValueError(f"optimizer.decay must be >= 0 or null, got {self.decay}")
        self.skip_bad_steps_config()  # a bad window fails here, naming the key
        clip = self.clip_update_norm
        if clip is not None and (clip.rolling_interval_length < 2 or clip.sigma_factor <= 0):
            raise ValueError(
                "optimizer.clip_update_norm needs rolling_interval_length >= 2 and sigma_factor > 0, "
                f"got {clip!r}"
            )

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "adam"

    # ------------------------------------------------------------------ schedule
    def lr_scheduler(
        self, num_train_steps: int, batch_sizes: BatchSchedule | None = None
    ) -> LrSchedule | Callable:
        """The learning rate as a function of the step (times the batch-size scaling, if any)."""
        schedule = LrSchedule(
            self.lr_schedule,
            self.learning_rate,
            num_train_steps,
            self.warmup,
            self.min_lr_ratio,
            decay=self.decay,
            cycles=self.cycles,
            cycle_length=self.cycle_length,
            rewarmup=self.rewarmup,
            timescale=self.timescale,
            cycle_peaks=self.cycle_peaks,
        )
        if batch_sizes is None or batch_sizes.is_constant or self.scale_lr_with_batch == "none":
            return schedule
        power = 0.5 if self.scale_lr_with_batch == "sqrt" else 1.0
        first = float(batch_sizes.sizes[0])

        def scaled(step):
            return schedule(step) * (batch_sizes.traced_size(step) / first) ** power

        scaled.phases = schedule.phases  # type: ignore[attr-defined]
        return scaled

    def skip_bad_steps_config(self) -> SkipBadStepsConfig | None:
        """``skip_bad_steps`` as its full settings, or None when off."""
        skip = self.skip_bad_steps
        if skip is False:
            return None
        if skip is True:
            return SkipBadStepsConfig()
        if isinstance(skip, int):
            return SkipBadStepsConfig(rolling_interval_length=skip)
        return skip

    def decay_mask(self, params):
        """The weight-decay mask of a parameter tree (see ``weight_decay_modules``)."""
        if self.weight_decay_modules is not None:
            return regex_mask(params, self.weight_decay_modules)
        if self.default_weight_decay_mask:
            return weight_decay_mask(params, decay_embeddings=self.decay_embeddings)
        return True

    # ------------------------------------------------------------------ chain
    @abc.abstractmethod
    def direction(self) -> optax.GradientTransformation:
        """The optimizer's own update direction (before clipping, decay and the learning rate)."""

    def build(
        self, num_train_steps: int, batch_sizes: BatchSchedule | None = None
    ) -> optax.GradientTransformationExtraArgs:
        """The optax transformation, with the schedule and weight-decay mask built in."""
        lr = self.lr_scheduler(num_train_steps, batch_sizes)
        parts = []
        if self.max_grad_norm is not None:
            parts.append(clip_by_global_norm(self.max_grad_norm))
        parts.append(self.direction())
        if self.update_rms_clipping is not None:
            parts.append(clip_update_rms(self.update_rms_clipping))
        if self.clip_update_norm is not None:
            clip = self.clip_update_norm
            parts.append(clip_update_norm(clip.rolling_interval_length, clip.sigma_factor))
        if self.weight_decay > 0:
            wd = self.weight_decay
            if self.adamc_weight_decay:
                peak = self.learning_rate
                decay = lambda count: wd * jnp.asarray(lr(count)) / peak  # noqa: E731
            else:
                decay = wd
            parts.append(optax.add_decayed_weights(decay, self.decay_mask))
        parts.append(optax.scale_by_learning_rate(lr))
        tx = optax.chain(*parts)
        skip = self.skip_bad_steps_config()
        if skip is not None:
            window = skip.rolling_interval_length
            tx = skip_bad_steps(
                tx, window=window, k=skip.sigma_factor, min_history=min(skip.min_history, window)
            )
        return tx
