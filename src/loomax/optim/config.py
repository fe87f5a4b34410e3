"""The ``optimizer`` section: a choice registry (``optimizer.type``) of optax chains."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import draccus
import optax

from loomax.optim.schedule import SCHEDULES, warmup_then_decay


@dataclass(frozen=True)
class OptimizerConfig(draccus.ChoiceRegistry, abc.ABC):
    """Fields shared by every optimizer: learning rate, schedule, decay and clipping."""

    learning_rate: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only unless `decay_embeddings`."""
    decay_embeddings: bool = False
    """Also decay embedding tables (biases and norms are never decayed)."""
    warmup: float = 0.01
    """Linear warmup: a fraction of training if < 1, else a number of steps."""
    lr_schedule: str = "cosine"
    """Decay after warmup: constant, linear or cosine."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global norm; null disables clipping."""

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

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "adam"

    def lr_scheduler(self, num_train_steps: int) -> optax.Schedule:
        """The learning rate as a function of the step."""
        return warmup_then_decay(
            self.lr_schedule, self.learning_rate, num_train_steps, self.warmup, self.min_lr_ratio
        )

    @abc.abstractmethod
    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """The optax transformation, with the schedule and weight-decay mask built in."""
