"""LogMetricsHook: cadence, throughput after the compile step, and filling other hooks' records."""

from __future__ import annotations

from loomax.callbacks import LogMetricsHook
from loomax.train.hooks import CompletedStep, StepInfo


def info(step, previous=None, record=None):
    i = StepInfo(step=step, state=None, metrics={}, previous=previous, record=record or {})
    i._host = {"train/loss": 1.0 / (step + 1), "optim/learning_rate": 0.1}
    return i


def done(step, at):
    return CompletedStep(step, {"train/loss": 1.0}, 0.5, at)


def test_logs_every_n_and_fills_other_records():
    hook = LogMetricsHook(log_every=3, tokens_per_step=100, flops_per_token=6.0, peak_flops=1e3)
    hook.on_train_begin(info(0))
    logged = {}
    for step in range(1, 7):
        extra = {"eval/loss": 2.0} if step == 4 else {}
        i = info(step, done(step - 1, float(step)) if step > 1 else None, dict(extra))
        hook.on_step(i)
        if i.record:
            logged[step] = i.record
    assert sorted(logged) == [3, 4, 6]
    assert logged[4]["eval/loss"] == 2.0 and "train/loss" in logged[4]
    for record in logged.values():
        assert "throughput/tokens_per_second" in record and "throughput/mfu" in record
        assert record["optim/learning_rate"] == 0.1


def test_end_logs_once_when_not_on_cadence():
    hook = LogMetricsHook(log_every=10, tokens_per_step=1, flops_per_token=None, peak_flops=None)
    hook.on_train_begin(info(0))
    final = info(3, done(3, 5.0))
    hook.on_train_end(final)
    assert final.record["train/loss"] == 1 / 4
    assert "throughput/mfu" not in final.record  # no peak known
