"""EvalHook cadence (start, every N, end once) and the NaN check's message."""

from __future__ import annotations

import pytest

from loomax.hooks import EvalHook, NanCheckHook, NonFiniteLossError
from loomax.train.hooks import CompletedStep, StepInfo


class State:
    model = "model"


def info(step, previous=None):
    return StepInfo(step=step, state=State(), metrics={}, previous=previous)


def test_eval_requests_at_start_every_and_end_without_repeat():
    calls = []
    hook = EvalHook(
        evaluate=lambda model: calls.append(model) or {"eval/loss": 1.0}, every=5, at_start=True
    )

    def run(method, step):
        i = info(step)
        getattr(hook, method)(i)
        if i.control.eval_requested:
            assert hook.run_eval(i) == {"eval/loss": 1.0}
        return i.control.eval_requested

    assert run("on_train_begin", 0)
    assert run("on_step", 5) and run("on_step", 10)
    assert not run("on_train_end", 10)  # already evaluated at 10
    assert run("on_train_end", 12)
    assert [s for s, _ in hook.history] == [0, 5, 10, 12] and calls == ["model"] * 4


def test_nan_check_names_step():
    hook = NanCheckHook()
    hook.on_step(info(2, CompletedStep(1, {"train/loss": 3.0}, 0.1, 0.0)))
    with pytest.raises(NonFiniteLossError, match="inf at step 7"):
        hook.on_step(info(8, CompletedStep(7, {"train/loss": float("inf")}, 0.1, 0.0)))


def test_nan_check_defers_to_a_hook_that_already_asked_to_stop():
    nan_step = CompletedStep(7, {"train/loss": float("nan")}, 0.1, 0.0)
    with pytest.raises(NonFiniteLossError, match="nan at step 7"):  # nobody asked: it raises
        NanCheckHook().on_step(info(8, nan_step))
    i = info(8, nan_step)
    i.control.stop("diverged", by="DivergenceDetector")
    NanCheckHook().on_step(i)  # no error: the divergence detector checkpoints and stops
    assert i.control.stop_reason == "diverged (requested by DivergenceDetector)"
    assert i.control.requested_by == ["stop by DivergenceDetector"]  # nothing added


def test_nan_check_catches_the_last_step_at_the_end_and_lets_finite_losses_pass():
    hook = NanCheckHook()
    hook.on_step(info(1))  # no finished step yet: nothing to check
    hook.on_step(info(3, CompletedStep(2, {"train/loss": 1e30}, 0.1, 0.0)))  # large, finite
    with pytest.raises(NonFiniteLossError, match="nan at step 9.*trainer.crash_on_nan: false"):
        hook.on_train_end(info(9, CompletedStep(9, {"train/loss": float("nan")}, 0.1, 0.0)))


def test_eval_hook_without_at_start_waits_for_its_interval():
    hook = EvalHook(evaluate=lambda model: {"eval/loss": 2.0}, every=4, at_start=False)
    begin = info(0)
    hook.on_train_begin(begin)
    assert (
        not begin.control.eval_requested and hook.every == 4
    )  # the trainer calls on_step at 4, 8...
    due = info(4)
    hook.on_step(due)
    assert due.control.eval_requested
    assert hook.history == []  # requesting is not evaluating: the trainer then calls run_eval
    assert hook.run_eval(due) == {"eval/loss": 2.0} and hook.run_eval(due) is None  # once a step


def test_eval_at_listed_steps_besides_every():
    from loomax.train import TrainerConfig

    hook = EvalHook(evaluate=lambda model: {"eval/loss": 1.0}, every=10, steps=[3, 7])
    assert hook.every == 1  # it sees every step, to catch the listed ones
    due = []
    for step in range(1, 21):
        i = info(step)
        hook.on_step(i)
        if i.control.eval_requested:
            due.append(step)
    assert due == [3, 7, 10, 20]
    own = EvalHook.Config.of_run(TrainerConfig(steps_per_eval=50, eval_steps=[5]))
    assert own.every == 50 and own.steps == [5]
    with pytest.raises(ValueError, match=r"trainer.hooks \(eval\): steps must be steps >= 1"):
        EvalHook.Config(steps=[0])
    with pytest.raises(ValueError, match=r"trainer.eval_steps must be steps >= 1"):
        TrainerConfig(eval_steps=[10, -1])


def test_eval_only_evaluates_once_and_trains_nothing(tiny, tmp_path):
    import json

    trainer = tiny.trainer(tmp_path, steps=5, eval_only=True)
    calls = []
    hook = EvalHook(evaluate=lambda model: calls.append(1) or {"eval/loss": 2.5}, at_start=True)
    trainer.add_hook(hook)
    steps_seen = []
    trainer.add_hook(lambda i: steps_seen.append(i.step))
    final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    assert final.step == 0 and steps_seen == [] and calls == [1]
    assert hook.history == [(0, {"eval/loss": 2.5})]
    assert trainer.stop_reason == "trainer.eval_only"
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["eval/loss"] == 2.5
