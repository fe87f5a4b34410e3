"""The pure train step, its state, the trainer loop and its hooks."""

from loomax.train.config import TrainerConfig
from loomax.train.control import Control, Decision
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo
from loomax.train.process import setup_process
from loomax.train.restore import check_restore_sources
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, StateExtra, StepContext, make_train_step
from loomax.train.trainer import Trainer

__all__ = [
    "CompletedStep",
    "Control",
    "Decision",
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
    "check_restore_sources",
    "hook_type",
    "make_train_step",
    "setup_process",
]
