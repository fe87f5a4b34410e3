"""Skip bad steps: wrap the run's optimizer so that loss or grad-norm spikes change nothing.

The decision is made inside the step (``loomax.optim.skip_bad_steps``); the step logs
``optim/skipped_step`` and ``optim/skipped_steps_total``.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from loomax.optim.skip_bad_steps import skip_bad_steps
from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook


class SkipBadStepsHook(Hook):
    """Contributes the optimizer wrapper; nothing runs on the host."""

    def __init__(self, window: int = 100, k: float = 6.0, min_history: int = 10):
        self.window, self.k, self.min_history = window, k, min_history
        skip_bad_steps(optax.identity(), window=window, k=k, min_history=min_history)  # validates

    def wrap_optimizer(
        self, optimizer: optax.GradientTransformation
    ) -> optax.GradientTransformation:
        return skip_bad_steps(optimizer, window=self.window, k=self.k, min_history=self.min_history)


@HookConfig.register_subclass("skip_bad_steps")
@dataclass(frozen=True)
class SkipBadStepsConfig(HookConfig):
    """Skip the update when loss or grad norm is k*std above the rolling mean (inside the step)."""

    window: int = 100
    """Accepted steps in the rolling window."""
    k: float = 6.0
    """Standard deviations above the mean that make a step bad."""
    min_history: int = 10
    """Accepted steps needed before anything is skipped (NaN/Inf always is)."""

    def __post_init__(self):
        check_positive(self, "window", "k", "min_history")
        if self.window < 2 or self.min_history > self.window:
            raise ValueError(
                f"trainer.hooks (skip_bad_steps): need window >= 2 and min_history <= window, got {self.window}, {self.min_history}"
            )

    def build(self, context: HookContext) -> Hook:
        return SkipBadStepsHook(self.window, self.k, self.min_history)
