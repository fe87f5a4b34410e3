"""Divergence detector: stop (after a checkpoint) or abort when the smoothed loss runs away.

The loss of each finished step feeds an exponential moving average. After ``warmup``
steps, the run counts as diverging while the EMA exceeds its best value by more than
``abs_threshold`` or by more than ``rel_threshold`` (a fraction of the best); after
``patience`` such steps in a row it acts. A NaN or infinite loss acts at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from loomax.errors import TrainingFailure
from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

ACTIONS = ("stop", "abort")


class DivergenceError(TrainingFailure, RuntimeError):
    """Training diverged and the divergence detector's action is ``abort`` (one line in the CLI, exit code 1)."""


@hook_type("divergence")
class DivergenceDetector(Hook):
    """Watches ``train/loss`` of finished steps; ``action`` is ``stop`` (checkpoint, then stop) or ``abort``."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Stop or abort when the EMA-smoothed loss runs away from its best (NaN/Inf at once)."""

        ema: float = 0.9
        """Smoothing of the loss EMA (weight of the previous value)."""
        abs_threshold: float | None = None
        """Diverging while the EMA exceeds its best by more than this; null = off."""
        rel_threshold: float | None = 0.5
        """Diverging while the EMA exceeds its best by more than this fraction of it; null = off."""
        patience: int = 3
        """Act after this many diverging steps in a row."""
        warmup: int = 10
        """Steps observed before divergence is judged (NaN/Inf acts at once)."""
        action: str = "stop"
        """stop (save a checkpoint, then stop cleanly) or abort (raise an error at once)."""

        def __post_init__(self):
            self.check_positive("patience", "abs_threshold", "rel_threshold")
            self.check(
                self.action in ACTIONS, f"action must be one of {ACTIONS}, got {self.action!r}"
            )
            self.check(0 <= self.ema < 1, f"ema must be in [0, 1), got {self.ema}")

    config: Config
    priority = 10  # before the NaN check, so that `stop` can act on a NaN

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        self.ema: float | None = None
        self.best = math.inf
        self.bad_steps = 0
        self.seen = 0
        self.triggered: str | None = None
        """Why it acted, once it has."""

    def on_step(self, info: StepInfo) -> None:
        if info.previous is not None:
            self.observe(info, info.previous.step, info.previous.metrics.get("train/loss"))

    def on_train_end(self, info: StepInfo) -> None:
        if info.previous is not None and info.previous.step == info.step:
            self.observe(info, info.step, info.previous.metrics.get("train/loss"))

    def observe(self, info: StepInfo, step: int, loss: float | None) -> None:
        """Take the loss of ``step`` into account and act if the run diverges."""
        if loss is None or self.triggered:
            return
        if not math.isfinite(loss):
            self._act(info, f"training loss is {loss} at step {step}")
            return
        c = self.config
        self.ema = loss if self.ema is None else c.ema * self.ema + (1 - c.ema) * loss
        self.seen += 1
        diverging = self.seen > c.warmup and (
            (c.abs_threshold is not None and self.ema > self.best + c.abs_threshold)
            or (c.rel_threshold is not None and self.ema > self.best * (1 + c.rel_threshold))
        )
        self.bad_steps = self.bad_steps + 1 if diverging else 0
        self.best = min(self.best, self.ema)
        if self.bad_steps >= c.patience:
            self._act(
                info,
                f"loss diverged at step {step}: smoothed loss {self.ema:.4f} vs best {self.best:.4f} "
                f"for {self.bad_steps} steps",
            )

    def _act(self, info: StepInfo, reason: str) -> None:
        self.triggered = reason
        logger.error("divergence detector: %s (action: %s)", reason, self.config.action)
        if self.config.action == "abort":
            raise DivergenceError(reason)
        info.control.save()
        info.control.stop(reason)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": self.ema,
            "best": self.best if math.isfinite(self.best) else None,
            "bad_steps": self.bad_steps,
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]
        self.best = math.inf if state["best"] is None else state["best"]
        self.bad_steps = state["bad_steps"]
        self.seen = state["seen"]
