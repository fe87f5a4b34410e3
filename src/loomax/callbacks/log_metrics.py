"""Log the step's metrics and throughput (tokens/s, MFU) to the tracker every N steps."""

from __future__ import annotations

import time

from loomax.train.hooks import Hook, StepInfo


class LogMetricsHook(Hook):
    """Every ``log_every`` steps (and at the end) log train metrics plus throughput.

    It also fills in any step another hook logs on (an eval off the log cadence), so
    every record of a training step carries the train metrics. Register it last.

    Throughput is measured from the moment the first step (which includes compilation)
    finished, then from one log to the next: both ends are moments a step was seen to
    finish, so it is the device's real rate. ``flops_per_token`` is per training token
    (forward + backward); with ``peak_flops`` (all devices together) MFU is logged too.
    """

    every = 1

    def __init__(
        self,
        log_every: int,
        tokens_per_step: int,
        flops_per_token: float | None,
        peak_flops: float | None,
    ):
        self.log_every = log_every
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._first_step: int | None = None
        self._mark: tuple[int, float] | None = None  # (step, when it finished)
        self._last_logged: int | None = None

    def on_train_begin(self, info: StepInfo) -> None:
        self._first_step = info.step + 1

    def on_step(self, info: StepInfo) -> None:
        self._see_first_step(info)
        if info.step % self.log_every == 0 or info.record:
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
        values = {k: v for k, v in info.host_metrics().items() if isinstance(v, int | float)}
        now = time.perf_counter()  # host_metrics waited for this step to finish
        if self._mark is not None and info.step > self._mark[0]:
            steps, seconds = info.step - self._mark[0], now - self._mark[1]
            tokens_per_second = self.tokens_per_step * steps / seconds
            values["throughput/tokens_per_second"] = tokens_per_second
            values["throughput/step_seconds"] = seconds / steps
            if self.flops_per_token and self.peak_flops:
                values["throughput/mfu"] = (
                    tokens_per_second * self.flops_per_token / self.peak_flops
                )
        if self._mark is not None or info.step == self._first_step:
            self._mark = (info.step, now)
        values["throughput/tokens"] = info.step * self.tokens_per_step
        info.log(values)
        self._last_logged = info.step
