"""``trainer.hooks: [{type: skip_bad_steps}]`` was removed: skipping bad steps is an optimizer option.

The type stays registered only to say how to migrate; its settings map to
``optimizer.skip_bad_steps`` (window -> rolling_interval_length, k -> sigma_factor,
min_history -> min_history).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from loomax.train.hook_config import HookConfig


@HookConfig.register_subclass("skip_bad_steps")
@dataclass(frozen=True)
class RemovedSkipBadStepsConfig(HookConfig):
    """Removed: use optimizer.skip_bad_steps."""

    removed: ClassVar[bool] = True
    window: int = 100
    """Now optimizer.skip_bad_steps.rolling_interval_length."""
    k: float = 6.0
    """Now optimizer.skip_bad_steps.sigma_factor."""
    min_history: int = 10
    """Now optimizer.skip_bad_steps.min_history."""

    def __post_init__(self):
        raise ValueError(
            "trainer.hooks (skip_bad_steps) was removed: skipping bad steps is an optimizer "
            "option now; drop the hook and write optimizer.skip_bad_steps: "
            f"{{rolling_interval_length: {self.window}, sigma_factor: {self.k}, "
            f"min_history: {self.min_history}}}"
        )
