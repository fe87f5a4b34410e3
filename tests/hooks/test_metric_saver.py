"""Metric saver: metrics_step{N}.json every N steps and the latest in metrics.json, glob-filtered."""

from __future__ import annotations

import json

from loomax.hooks import MetricSaverHook
from loomax.train import StepInfo


def test_writes_filtered_step_files_and_latest(tmp_path):
    hook = MetricSaverHook(run_dir=tmp_path, every=2, include=["train/*", "eval/loss"])
    for step in (1, 2, 3):
        record = {"train/loss": 1.0 / step, "optim/learning_rate": 0.1}
        if step == 2:
            record["eval/loss"] = 4.0
        hook.pre_log(StepInfo(step, None, {}), record)
    assert sorted(p.name for p in tmp_path.glob("metrics_step*.json")) == ["metrics_step2.json"]
    assert json.loads((tmp_path / "metrics_step2.json").read_text()) == {
        "step": 2,
        "train/loss": 0.5,
        "eval/loss": 4.0,
    }
    latest = json.loads((tmp_path / "metrics.json").read_text())
    assert latest == {"train/loss": 1 / 3, "eval/loss": 4.0, "step": 3}
