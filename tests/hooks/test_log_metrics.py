"""LogMetricsHook cadence and fill-in; SpeedMonitorHook throughput after the compile step."""

from __future__ import annotations

import numpy as np

from loomax.hooks import LogMetricsHook, SpeedMonitorHook
from loomax.train.hooks import CompletedStep, StepInfo


def info(step, previous=None, record=None):
    metrics = {"train/loss": np.float64(1.0 / (step + 1)), "optim/learning_rate": np.float64(0.1)}
    return StepInfo(step=step, state=None, metrics=metrics, previous=previous, record=record or {})


def done(step, at):
    return CompletedStep(step, {"train/loss": 1.0}, 0.5, at)


def test_logs_every_n_and_fills_other_records_in_pre_log():
    hook = LogMetricsHook(every=3, tokens_per_step=100)
    logged = {}
    for step in range(1, 7):
        i = info(step)
        if step % hook.every == 0:  # as the trainer calls it
            hook.on_step(i)
        record = dict(i.record)
        if step == 4:
            record["eval/loss"] = 2.0  # logged by another hook
        if record:
            hook.pre_log(i, record)
            logged[step] = record
    assert sorted(logged) == [3, 4, 6]
    assert logged[4]["eval/loss"] == 2.0 and logged[4]["train/loss"] == 1 / 5
    assert logged[6]["throughput/tokens"] == 600 and logged[6]["optim/learning_rate"] == 0.1


def test_end_logs_once_when_not_on_cadence():
    hook = LogMetricsHook(every=10, tokens_per_step=1)
    final = info(3, done(3, 5.0))
    hook.on_train_end(final)
    assert final.record["train/loss"] == 1 / 4


def test_speed_monitor_measures_from_first_finished_step():
    hook = SpeedMonitorHook(every=2, tokens_per_step=100, flops_per_token=6.0, peak_flops=1e3)
    hook.on_train_begin(info(0))
    records = {}
    for step in range(1, 7):
        i = info(step, done(step - 1, float(step)) if step > 1 else None)
        hook.on_step(i)
        records[step] = i.record
    assert "throughput/mfu" in records[4] and records[4]["throughput/steps_per_second"] > 0
    no_peak = SpeedMonitorHook(every=1, tokens_per_step=1)
    no_peak.on_train_begin(info(0))
    for step in (1, 2, 3):
        i = info(step, done(step - 1, float(step)) if step > 1 else None)
        no_peak.on_step(i)
        if step == 1:
            assert i.record == {}  # step 1 (with compilation) not yet seen finished
    assert "throughput/tokens_per_second" in i.record and "throughput/mfu" not in i.record
