"""Log the step's train metrics to the tracker every N steps (and fill other hooks' records)."""

from __future__ import annotations

from typing import Any

from loomax.callbacks.tokens import TokenCount, token_count
from loomax.train.hooks import Hook, StepInfo


class LogMetricsHook(Hook):
    """Every ``log_every`` steps (and at the end) log the step's scalar metrics.

    It also fills in any step another hook logs on (an eval off the log cadence, in
    ``pre_log``), so every record of a training step carries the train metrics. Its low
    ``priority`` makes it run after the other hooks. Throughput comes from
    ``SpeedMonitorHook``.
    """

    every = 1
    priority = -100

    def __init__(self, log_every: int, tokens_per_step: int | TokenCount):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.log_every = log_every
        self.tokens = token_count(tokens_per_step)
        self._last_logged: int | None = None

    def on_step(self, info: StepInfo) -> None:
        if info.step % self.log_every == 0:
            self._log(info, info.record)

    def on_train_end(self, info: StepInfo) -> None:
        if self._last_logged != info.step:
            self._log(info, info.record)

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        if "train/loss" not in record:
            self._log(info, record)

    def _log(self, info: StepInfo, record: dict[str, Any]) -> None:
        values = {k: v for k, v in info.host_metrics().items() if isinstance(v, int | float)}
        values["throughput/tokens"] = self.tokens(info.step)
        for key, value in values.items():
            record.setdefault(key, value)
        self._last_logged = info.step
