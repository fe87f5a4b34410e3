"""jsonl, noop and composite trackers, and the process-0 rule."""

from __future__ import annotations

import json
import math

from loomax.tracking import CompositeTracker, JsonlTrackerConfig, NoopTrackerConfig, build_tracker

from .conftest import read_jsonl


def test_jsonl_writes_one_object_per_call_and_summary(tmp_path):
    tracker = JsonlTrackerConfig().init(tmp_path)
    tracker.log({"train/loss": 2.5, "eval/loss": float("nan")}, step=3)
    tracker.log({"train/loss": 2.0}, step=4)
    tracker.log_hyperparameters({"trainer.seed": 0})
    tracker.log_summary({"final": 1.5})
    tracker.finish()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 4]
    assert records[0]["eval/loss"] == "nan"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final": 1.5}
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"trainer.seed": 0}


def test_jsonl_appends_on_resume(tmp_path):
    for step in (1, 2):
        t = JsonlTrackerConfig(path=str(tmp_path / "m.jsonl")).init(tmp_path)
        t.log({"x": math.pi}, step=step)
        t.finish()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_list_builds_composite(tmp_path):
    tracker = build_tracker([JsonlTrackerConfig(), NoopTrackerConfig()], tmp_path)
    assert isinstance(tracker, CompositeTracker) and len(tracker.trackers) == 2
    tracker.log({"a": 1}, step=1)
    tracker.finish()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
