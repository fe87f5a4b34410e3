"""A console log line every N steps (or seconds): step, the chosen metrics, tokens/s.

The line is of the last finished step: its metrics whose names match ``metrics`` (globs;
``train/loss`` shows as ``loss``, ``optim/learning_rate`` as ``lr``), then tokens/s.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from loomax.hooks.tokens import TokenCount, token_count, tokens_of_step
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger("loomax.console")


@hook_type("console")
class ConsoleHook(Hook):
    """Logs ``step N/T | loss | lr | tok/s`` for the last finished step every ``every`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """A log line with the chosen metrics and tokens/s every N steps (or seconds)."""

        every: int = 10
        """Write a line every this many steps (unless seconds is set)."""
        seconds: float | None = None
        """Write a line whenever this many seconds have passed since the last one; null = by steps."""
        metrics: list[str] = field(default_factory=lambda: ["train/loss", "optim/learning_rate"])
        """Glob patterns of the finished step's metrics shown, in this order."""
        tokens_per_second: bool = True
        """Also show the tokens per second of the finished step."""

        def __post_init__(self):
            self.check_positive("every", "seconds")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        total_steps: int,
        tokens_per_step: int | TokenCount,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        if self.config.seconds is not None:
            self.every = 1  # it looks at the clock after every step
        self._last_line = time.monotonic()
        self.total_steps = total_steps
        self.tokens = token_count(tokens_per_step)
        self.lines: list[str] = []
        """The lines written (the latest few hundred)."""

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(
            config,
            total_steps=context.trainer_config.num_train_steps,
            tokens_per_step=context.tokens_per_step,
        )

    def on_step(self, info: StepInfo) -> None:
        done = info.previous
        seconds = self.config.seconds
        if done is None or (seconds and time.monotonic() - self._last_line < seconds):
            return
        self._last_line = time.monotonic()
        parts = [f"step {done.step}/{self.total_steps}"]
        shown = set()
        for pattern in self.config.metrics:
            for key in sorted(k for k in done.metrics if fnmatch.fnmatch(k, pattern)):
                if key not in shown:
                    shown.add(key)
                    parts.append(_shown(key, done.metrics[key]))
        if self.config.tokens_per_second and done.duration > 0:
            parts.append(f"{tokens_of_step(self.tokens, done.step) / done.duration:,.0f} tok/s")
        line = " | ".join(parts)
        self.lines = [*self.lines[-255:], line]
        logger.info(line)


def _shown(key: str, value: float) -> str:
    if key == "train/loss":
        return f"loss {value:.4f}"
    if key == "optim/learning_rate":
        return f"lr {value:.3g}"
    return f"{key} {value:.4g}" if math.isfinite(value) else f"{key} {value}"
