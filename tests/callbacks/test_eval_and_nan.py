"""EvalHook cadence (start, every N, end once) and the NaN check's message."""

from __future__ import annotations

import pytest

from loomax.callbacks import EvalHook, NanCheckHook, NonFiniteLossError
from loomax.train.hooks import CompletedStep, StepInfo


class State:
    model = "model"


def info(step, previous=None):
    return StepInfo(step=step, state=State(), metrics={}, previous=previous)


def test_eval_at_start_every_and_end_without_repeat():
    calls = []
    hook = EvalHook(lambda model: calls.append(model) or {"eval/loss": 1.0}, every=5, at_start=True)
    hook.on_train_begin(info(0))
    for step in (5, 10):
        i = info(step)
        hook.on_step(i)
        assert i.record["eval/loss"] == 1.0
    hook.on_train_end(info(10))  # already evaluated at 10
    hook.on_train_end(info(12))
    assert [s for s, _ in hook.history] == [0, 5, 10, 12]


def test_nan_check_names_step():
    hook = NanCheckHook()
    hook.on_step(info(2, CompletedStep(1, {"train/loss": 3.0}, 0.1, 0.0)))
    with pytest.raises(NonFiniteLossError, match="inf at step 7"):
        hook.on_step(info(8, CompletedStep(7, {"train/loss": float("inf")}, 0.1, 0.0)))
