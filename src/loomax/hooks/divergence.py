"""Divergence detector: stop (after a checkpoint) or abort when the smoothed loss runs away.

The watched ``metric`` (``train/loss`` of each finished step by default; an eval key such
as ``eval/loss`` is read from each evaluation's results) feeds an exponential moving
average. After ``warmup`` observations, the run counts as diverging while the EMA exceeds
its best value by more than ``abs_threshold`` or by more than ``rel_threshold`` (a
fraction of the best); after ``patience`` such observations in a row it acts. A NaN or
infinite value acts at once.
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
    """Watches ``metric`` (``train/loss`` of finished steps, or a key of the evaluations' results).

    ``action`` is ``stop`` (checkpoint, then stop) or ``abort``. A stop asked after an
    evaluation takes effect at the end of the next step.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Stop or abort when the EMA-smoothed loss runs away from its best (NaN/Inf at once)."""

        metric: str = "train/loss"
        """The value watched: a step metric (train/loss) or an eval result key (eval/loss); larger is worse."""
        ema: float = 0.9
        """Smoothing of the loss EMA (weight of the previous value)."""
        abs_threshold: float | None = None
        """Diverging while the EMA exceeds its best by more than this; null = off."""
        rel_threshold: float | None = 0.5
        """Diverging while the EMA exceeds its best by more than this fraction of it; null = off."""
        patience: int = 3
        """Act after this many diverging observations (steps, or evaluations for an eval metric) in a row."""
        warmup: int = 10
        """Observations (steps, or evaluations for an eval metric) before divergence is judged (NaN/Inf acts at once)."""
        action: str = "stop"
        """stop (save a checkpoint, then stop cleanly) or abort (raise an error at once)."""

        def __post_init__(self):
            self.check_positive("patience", "abs_threshold", "rel_threshold")
            self.check(
                self.action in ACTIONS, f"action must be one of {ACTIONS}, got {self.action!r}"
            )
            self.check(0 <= self.ema < 1, f"ema must be in [0, 1), got {self.ema}")
            self.check(bool(self.metric), "metric must name a metric, e.g. train/loss or eval/loss")
            self.check(
                self.abs_threshold is not None or self.rel_threshold is not None,
                "set abs_threshold or rel_threshold (both are null: nothing would be judged)",
            )

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
            self.observe(info, info.previous.step, info.previous.metrics.get(self.config.metric))

    def on_train_end(self, info: StepInfo) -> None:
        if info.previous is not None and info.previous.step == info.step:
            self.observe(info, info.step, info.previous.metrics.get(self.config.metric))

    def on_eval(self, info: StepInfo, results: dict[str, float]) -> None:
        self.observe(info, info.step, results.get(self.config.metric))

    def observe(self, info: StepInfo, step: int, loss: float | None) -> None:
        """Take the watched value of ``step`` into account and act if the run diverges."""
        if loss is None or self.triggered:
            return
        loss = float(loss)
        metric = self.config.metric
        if not math.isfinite(loss):
            what = "training loss" if metric == "train/loss" else metric
            self._act(info, f"{what} is {loss} at step {step}")
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
                f"{'loss' if metric == 'train/loss' else metric} diverged at step {step}: "
                f"smoothed {self.ema:.4f} vs best {self.best:.4f} for {self.bad_steps} "
                f"{'steps' if metric == 'train/loss' else 'observations'}",
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
