"""Divergence detector: a run whose loss is made to spike stops after a checkpoint; NaN aborts at once."""

from __future__ import annotations

import math

import pytest

from loomax.hooks import DivergenceDetector, DivergenceError
from loomax.train import StepInfo
from loomax.train.hooks import CompletedStep


def test_spiking_run_is_checkpointed_then_stopped(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=30, loss_fn=tiny.spiking_loss())
    detector = DivergenceDetector(ema=0.5, rel_threshold=0.5, patience=2, warmup=2)
    trainer.add_hook(detector)
    final = trainer.train(tiny.init(trainer), tiny.batches(spike_at=range(4, 100)))
    trainer.finish()
    # steps 1-4 are normal, 5 and 6 spike: seen one step late, so the stop comes after step 7
    assert final.step == 7
    assert "loss diverged at step 6" in trainer.stop_reason
    assert "requested by DivergenceDetector" in trainer.stop_reason
    assert (tmp_path / "run" / "checkpoints" / "step-7" / "metadata.json").exists()


def feed(detector, losses):
    for step, loss in enumerate(losses, 1):
        info = StepInfo(
            step + 1, None, {}, previous=CompletedStep(step, {"train/loss": loss}, 0.1, 0)
        )
        detector.on_step(info)
    return info


def test_nan_aborts_at_once_and_state_round_trips():
    detector = DivergenceDetector(action="abort", warmup=100)
    with pytest.raises(DivergenceError, match="training loss is nan at step 3"):
        feed(detector, [3.0, 2.9, math.nan])
    calm = DivergenceDetector(ema=0.0, abs_threshold=1.0, rel_threshold=None, patience=2, warmup=1)
    info = feed(calm, [3.0, 2.0, 3.5])  # 3.5 > best 2.0 + 1.0 once: not yet patience
    assert calm.bad_steps == 1 and info.control.stop_reason is None
    again = DivergenceDetector(ema=0.0, abs_threshold=1.0, rel_threshold=None, patience=2, warmup=1)
    again.load_state_dict(calm.state_dict())
    info = feed(again, [3.6])
    assert info.control.stop_reason is not None and info.control.save_requested


def test_watches_an_eval_metric_from_the_evaluations():
    detector = DivergenceDetector(
        metric="eval/loss", ema=0.0, rel_threshold=0.5, patience=2, warmup=1
    )
    feed(detector, [100.0, 200.0, 300.0])  # train losses: not the watched metric
    assert detector.seen == 0
    for step, loss in [(10, 3.0), (20, 2.0), (30, 3.5)]:
        info = StepInfo(step, None, {})
        detector.on_eval(info, {"eval/loss": loss, "eval/perplexity": math.exp(loss)})
    assert detector.bad_steps == 1 and info.control.stop_reason is None
    info = StepInfo(40, None, {})
    detector.on_eval(info, {"eval/loss": 4.0})
    assert "eval/loss diverged at step 40" in info.control.stop_reason
    nan = DivergenceDetector(metric="eval/loss", action="abort")
    with pytest.raises(DivergenceError, match="eval/loss is nan at step 5"):
        nan.on_eval(StepInfo(5, None, {}), {"eval/loss": math.nan})


def test_a_config_without_any_threshold_is_refused():
    with pytest.raises(
        ValueError, match=r"trainer.hooks \(divergence\): set abs_threshold or rel_threshold"
    ):
        DivergenceDetector(rel_threshold=None)
    with pytest.raises(ValueError, match=r"trainer.hooks \(divergence\): metric must name"):
        DivergenceDetector(metric="")
