"""Optimizers (optax chains chosen by ``optimizer.type``) and learning-rate schedules."""

from loomax.optim.adam import AdamConfig
from loomax.optim.config import OptimizerConfig
from loomax.optim.mask import weight_decay_mask
from loomax.optim.schedule import warmup_then_decay

__all__ = ["AdamConfig", "OptimizerConfig", "warmup_then_decay", "weight_decay_mask"]
