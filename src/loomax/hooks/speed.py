"""Speed monitor: tokens/s, steps/s and MFU every N steps, from steps seen to finish."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from loomax.hooks.tokens import TokenCount, token_count
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("speed")
class SpeedMonitorHook(Hook):
    """Logs ``throughput/{tokens_per_second,steps_per_second,step_seconds,mfu}`` every ``every`` steps.

    Measured from the moment the first step (which includes compilation) finished, then
    from one log to the next: both ends are moments a step was seen to finish, so it is
    the device's real rate. ``flops_per_token`` is per training token (forward and
    backward; the run passes 3 x ``LmConfig.flops_per_token``, causal attention counted as
    half the score matrix); with ``peak_flops`` (all devices together) MFU is logged too.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Throughput and MFU (the run adds one at trainer.log_every; add this for another cadence)."""

        every: int = 10
        """Log throughput every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config
    sees_every_step = True  # it keeps its own cadence with config.every

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        tokens_per_step: int | TokenCount,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.tokens = token_count(tokens_per_step)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._first_step: int | None = None
        self._mark: tuple[int, float] | None = None  # (step, when it finished)
        self._last_logged: int | None = None

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(
            config,
            tokens_per_step=context.tokens_per_step,
            flops_per_token=context.flops_per_token,
            peak_flops=context.peak_flops,
        )

    def on_train_begin(self, info: StepInfo) -> None:
        self._first_step = info.step + 1

    def on_step(self, info: StepInfo) -> None:
        self._see_first_step(info)
        if info.step % self.config.every == 0:
            self._log(info)

    def on_train_end(self, info: StepInfo) -> None:
        self._see_first_step(info)
        if self._last_logged != info.step:
            self._log(info)

    def _see_first_step(self, info: StepInfo) -> None:
        done = info.previous
        if self._mark is None and done is not None and done.step == self._first_step:
            self._mark = (done.step, done.finished_at)

    def _log(self, info: StepInfo) -> None:
        info.host_metrics()  # wait for this step to finish
        now = time.perf_counter()
        if self._mark is not None and info.step > self._mark[0]:
            steps, seconds = info.step - self._mark[0], now - self._mark[1]
            values = {
                "throughput/tokens_per_second": (
                    self.tokens(info.step) - self.tokens(self._mark[0])
                )
                / seconds,
                "throughput/steps_per_second": steps / seconds,
                "throughput/step_seconds": seconds / steps,
            }
            if self.flops_per_token and self.peak_flops:
                values["throughput/mfu"] = (
                    values["throughput/tokens_per_second"] * self.flops_per_token / self.peak_flops
                )
            info.log(values)
        if self._mark is not None or info.step == self._first_step:
            self._mark = (info.step, now)
        self._last_logged = info.step
