"""A console log line every N steps: step, loss, learning rate, tokens/s (from finished steps)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from loomax.callbacks.tokens import TokenCount, token_count, tokens_of_step
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger("loomax.console")


@hook_type("console")
class ConsoleHook(Hook):
    """Logs ``step N/T | loss | lr | tok/s`` for the last finished step every ``every`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """A log line with loss, learning rate and tokens/s every N steps."""

        every: int = 10
        """Write a line every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

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
        if done is None:
            return
        parts = [f"step {done.step}/{self.total_steps}"]
        if "train/loss" in done.metrics:
            parts.append(f"loss {done.metrics['train/loss']:.4f}")
        if "optim/learning_rate" in done.metrics:
            parts.append(f"lr {done.metrics['optim/learning_rate']:.3g}")
        if done.duration > 0:
            parts.append(f"{tokens_of_step(self.tokens, done.step) / done.duration:,.0f} tok/s")
        line = " | ".join(parts)
        self.lines = [*self.lines[-255:], line]
        logger.info(line)
