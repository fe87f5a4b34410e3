"""Early stopping: stop when the eval loss has not improved for ``patience`` evaluations."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


@hook_type("early_stopping")
class EarlyStoppingHook(Hook):
    """Watches ``metric`` (lower is better) in each evaluation's results."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Stop when an eval metric has not improved for `patience` evaluations."""

        patience: int = 3
        """Evaluations without improvement before stopping."""
        metric: str = "eval/loss"
        """The metric watched (lower is better)."""
        min_delta: float = 0.0
        """An improvement must be larger than this."""

        def __post_init__(self):
            self.check_positive("patience")

    config: Config

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        self.best = math.inf
        self.evals_without_improvement = 0

    def on_eval(self, info: StepInfo, results: dict[str, float]) -> None:
        c = self.config
        value = results.get(c.metric)
        if value is None:
            return
        if value < self.best - c.min_delta:
            self.best, self.evals_without_improvement = value, 0
            return
        self.evals_without_improvement += 1
        if self.evals_without_improvement >= c.patience:
            info.control.stop(
                f"{c.metric} has not improved on {self.best:.4f} for "
                f"{self.evals_without_improvement} evaluations"
            )

    def state_dict(self) -> dict[str, Any]:
        best = self.best if math.isfinite(self.best) else None
        return {"best": best, "evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = math.inf if state["best"] is None else state["best"]
        self.evals_without_improvement = state["evals_without_improvement"]
