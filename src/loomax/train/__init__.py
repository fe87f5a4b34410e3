"""The pure train step, its state, the trainer loop and its hooks."""

from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, StepContext, make_train_step
from loomax.train.trainer import Trainer, TrainerConfig

__all__ = [
    "CompletedStep",
    "FnHook",
    "Hook",
    "JitHook",
    "StepContext",
    "StepInfo",
    "Trainer",
    "TrainerConfig",
    "TrainerState",
    "make_train_step",
]
