"""A tqdm progress bar with the latest loss and tokens/s (never waits on the device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from loomax.hooks.tokens import TokenCount, token_count, tokens_of_step
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("progress")
class ProgressBarHook(Hook):
    """Advances every step; shows the loss and speed of the last finished step."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """A tqdm progress bar (the run adds one when trainer.progress_bar is true)."""

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
        self.bar: tqdm | None = None

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook | list[Hook]:
        if not context.primary:  # one bar per run: process 0's
            return []
        return cls(
            config,
            total_steps=context.trainer_config.num_train_steps,
            tokens_per_step=context.tokens_per_step,
        )

    def on_train_begin(self, info: StepInfo) -> None:
        self.bar = tqdm(
            total=self.total_steps, initial=info.step, desc="train", unit="step", dynamic_ncols=True
        )

    def on_step(self, info: StepInfo) -> None:
        assert self.bar is not None
        self.bar.update(info.step - self.bar.n)
        if info.previous is not None:
            self._show(info)

    def on_train_end(self, info: StepInfo) -> None:
        if self.bar is None:
            return
        self.bar.update(info.step - self.bar.n)
        if info.previous is not None:
            self._show(info)
        self.bar.close()

    def _show(self, info: StepInfo) -> None:
        done = info.previous
        postfix = {"loss": f"{done.metrics.get('train/loss', float('nan')):.3f}"}
        if done.duration > 0:
            postfix["tok/s"] = f"{tokens_of_step(self.tokens, done.step) / done.duration:,.0f}"
        self.bar.set_postfix(postfix, refresh=False)
