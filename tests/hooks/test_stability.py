"""Stability monitor: the spike score matches a hand computation."""

from __future__ import annotations

import pytest

from loomax.hooks import StabilityMonitor
from loomax.train import StepInfo
from loomax.train.hooks import CompletedStep


def test_spike_score_by_hand():
    monitor = StabilityMonitor(window=4, k=1.0, every=1, min_history=3)
    losses = [1.0, 1.0, 1.0, 5.0, 1.0, 1.0]
    for step, loss in enumerate(losses, 1):
        metrics = {"train/loss": loss, "optim/grad_norm": 1.0}
        info = StepInfo(step + 1, None, {}, previous=CompletedStep(step, metrics, 0.1, 0))
        monitor.on_step(info)
    # step 4: 5 > mean 1 + 1*std 0 -> spike; step 5: past [1,1,1,5], 1 < 2 + 1.73 -> no;
    # step 6: past [1,1,5,1] -> no. Steps 1-3 have too little history to be judged.
    assert list(monitor.flags) == [True, False, False]
    assert monitor.score == pytest.approx(1 / 3)
    assert info.record == {
        "stability/spike_score": pytest.approx(1 / 3),
        "stability/spikes": 1,
        "stability/total_spikes": 1,
    }
    again = StabilityMonitor(window=4, k=1.0, min_history=3)
    again.load_state_dict(monitor.state_dict())
    assert again.score == monitor.score and again.total_spikes == 1
    assert list(again.history["train/loss"]) == [1.0, 5.0, 1.0, 1.0]


def test_chosen_metrics_and_a_total_that_outlives_the_window():
    monitor = StabilityMonitor(window=3, k=1.0, every=1, min_history=2, metrics=["optim/grad_norm"])
    norms = [1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 20.0]
    for step, norm in enumerate(norms, 1):  # the loss spikes too, but is not watched
        metrics = {"train/loss": 100.0 if step == 5 else 1.0, "optim/grad_norm": norm}
        info = StepInfo(step + 1, None, {}, previous=CompletedStep(step, metrics, 0.1, 0))
        monitor.on_step(info)
    assert set(monitor.history) == {"optim/grad_norm"}
    # steps 3 and 8 spiked; the window (3 judged steps) holds only step 8 by now
    assert info.record["stability/spikes"] == 1 and info.record["stability/total_spikes"] == 2
    with pytest.raises(ValueError, match=r"\(stability\): metrics must name"):
        StabilityMonitor(metrics=[])
