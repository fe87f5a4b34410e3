"""Log the step's train metrics to the tracker every N steps (and fill other hooks' records)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loomax.hooks.tokens import TokenCount, token_count
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("log_metrics")
class LogMetricsHook(Hook):
    """Every ``every`` steps (and at the end) log the step's scalar metrics.

    It also fills in any step another hook logs on (an eval off the log cadence, in
    ``pre_log``), so every record of a training step carries the train metrics. Its low
    ``priority`` makes it run after the other hooks. Throughput comes from
    ``SpeedMonitorHook``.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Train metrics to the tracker every N steps (the run adds one at trainer.log_every)."""

        every: int = 10
        """Log every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config
    priority = -100

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        tokens_per_step: int | TokenCount,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.tokens = token_count(tokens_per_step)
        self._last_logged: int | None = None

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, tokens_per_step=context.tokens_per_step)

    def on_step(self, info: StepInfo) -> None:
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
