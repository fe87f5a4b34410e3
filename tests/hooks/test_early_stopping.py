"""Early stopping: stop once the eval loss has not improved for `patience` evaluations."""

from __future__ import annotations

from loomax.hooks import EarlyStoppingHook
from loomax.train import StepInfo


def evals(hook, losses):
    stops = []
    for step, loss in enumerate(losses):
        info = StepInfo(step, None, {})
        hook.on_eval(info, {"eval/loss": loss})
        stops.append(info.control.stop_reason is not None)
    return stops


def test_stops_after_patience_evals_without_improvement():
    hook = EarlyStoppingHook(patience=2, min_delta=0.01)
    assert evals(hook, [3.0, 2.5, 2.495, 2.6]) == [False, False, False, True]
    resumed = EarlyStoppingHook(patience=3)
    resumed.load_state_dict({"best": 2.5, "evals_without_improvement": 2})
    assert evals(resumed, [2.7]) == [True]
    assert EarlyStoppingHook(patience=1).state_dict() == {
        "best": None,
        "evals_without_improvement": 0,
    }
