"""Stop the run with a clear error as soon as the training loss is NaN or infinite."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loomax.errors import TrainingFailure
from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import CompletedStep, Hook, StepInfo


class NonFiniteLossError(TrainingFailure, FloatingPointError):
    """The training loss became NaN or infinite (the CLI says so in one line, exit code 1)."""


@hook_type("nan_check")
class NanCheckHook(Hook):
    """Checks the loss of each finished step (one step behind, so it never stalls the device)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Stop with an error at a NaN/Inf loss (the run adds one when trainer.crash_on_nan is true)."""

    every = 1

    def on_step(self, info: StepInfo) -> None:
        if info.previous is not None and info.control.stop_reason is None:
            _check(info.previous)  # a hook that already asked to stop (divergence) goes first

    def on_train_end(self, info: StepInfo) -> None:
        if info.previous is not None:
            _check(info.previous)


def _check(done: CompletedStep) -> None:
    loss = done.metrics.get("train/loss")
    if loss is not None and not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss is {loss} at step {done.step}; stopping (set trainer.crash_on_nan: false to "
            "continue). Lower optimizer.learning_rate, raise optimizer.warmup, or check the data."
        )
