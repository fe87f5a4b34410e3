"""Stability monitor: the share of recent steps whose loss or grad norm spiked.

A step spikes when one of the watched ``metrics`` (loss and gradient norm by default)
exceeds ``mean + k * std`` of the ``window`` steps before it (population std, once
``min_history`` steps are known). The spike score is the share of spiking steps among the
last ``window`` judged ones; ``stability/total_spikes`` counts them since the run began
(kept in checkpoints).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo

WATCHED = ("train/loss", "optim/grad_norm")


@hook_type("stability")
class StabilityMonitor(Hook):
    """Logs ``stability/spike_score``, ``stability/spikes`` (in the window) and
    ``stability/total_spikes`` every ``every`` steps (it sees each finished step)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Spike score: share of recent steps whose watched metrics exceeded mean + k*std."""

        window: int = 100
        """Steps in the rolling window."""
        k: float = 3.0
        """Standard deviations above the mean that make a spike."""
        every: int = 10
        """Log the score every this many steps."""
        min_history: int = 10
        """Steps needed in the window before a step is judged."""
        metrics: list[str] = field(default_factory=lambda: list(WATCHED))
        """Step metrics watched for spikes (a step spikes if any of them does)."""

        def __post_init__(self):
            self.check_positive("window", "k", "every", "min_history")
            self.check(bool(self.metrics), "metrics must name at least one metric, e.g. train/loss")

    config: Config
    sees_every_step = True  # it keeps its own cadence with config.every

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        window = self.config.window
        self.history = {key: deque(maxlen=window) for key in self.config.metrics}
        self.flags: deque[bool] = deque(maxlen=window)
        self.total_spikes = 0
        """Spiking steps since the run began."""

    def observe(self, metrics: dict[str, float]) -> bool:
        """Judge one finished step's metrics; returns whether it spiked."""
        spike = False
        judged = False
        for key, past in self.history.items():
            value = metrics.get(key)
            if value is None:
                continue
            if len(past) >= self.config.min_history:
                judged = True
                values = np.asarray(past)
                spike |= bool(value > values.mean() + self.config.k * values.std())
            past.append(value)
        if judged:
            self.flags.append(spike)
            self.total_spikes += spike
        return spike

    @property
    def score(self) -> float:
        """Share of spiking steps among the recent judged ones (0 before any is judged)."""
        return float(np.mean(self.flags)) if self.flags else 0.0

    def on_step(self, info: StepInfo) -> None:
        if info.previous is not None:
            self.observe(info.previous.metrics)
        if info.step % self.config.every == 0:
            info.log(
                {
                    "stability/spike_score": self.score,
                    "stability/spikes": sum(self.flags),
                    "stability/total_spikes": self.total_spikes,
                }
            )

    def state_dict(self) -> dict[str, Any]:
        history = {k: list(v) for k, v in self.history.items()}
        return {"history": history, "flags": list(self.flags), "total": self.total_spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, values in state["history"].items():
            if key in self.history:  # a metric no longer watched is dropped
                self.history[key] = deque(values, maxlen=self.config.window)
        self.flags = deque(state["flags"], maxlen=self.config.window)
        self.total_spikes = state.get("total", sum(self.flags))  # older checkpoints: the window
