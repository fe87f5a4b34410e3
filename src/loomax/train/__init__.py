"""The pure train step, its state, the trainer loop and its hooks."""

from loomax.train.control import Control
from loomax.train.hook_config import HookConfig, HookContext
from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, StateExtra, StepContext, make_train_step
from loomax.train.trainer import Trainer, TrainerConfig

__all__ = [
    "CompletedStep",
    "Control",
    "FnHook",
    "Hook",
    "HookConfig",
    "HookContext",
    "JitHook",
    "StateExtra",
    "StepContext",
    "StepInfo",
    "Trainer",
    "TrainerConfig",
    "TrainerState",
    "make_train_step",
]
