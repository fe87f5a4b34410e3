"""The tensorboard tracker; its event files are read back with tensorboard's event reader."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from loomax.tracking import (
    CompositeTracker,
    JsonlTrackerConfig,
    MissingPackageError,
    TensorboardTrackerConfig,
    build_tracker,
    check_trackers,
)

from .conftest import read_events, text_of


def test_scalars_config_and_summary_are_read_back(tmp_path):
    tracker = TensorboardTrackerConfig().init(tmp_path)
    tracker.log_hyperparameters({"trainer.seed": 7})
    tracker.log({"train/loss": np.float32(3.0), "note": "not a number"}, step=1)
    tracker.log({"train/loss": 2.0, "eval/loss": 2.5}, step=2)
    tracker.log_summary({"eval/loss": 2.5})
    tracker.finish()

    events = read_events(tmp_path / "tensorboard")
    assert sorted(events.Tags()["scalars"]) == ["eval/loss", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 2.5)]
    assert json.loads(text_of(events, "config").strip("`\n")) == {"trainer.seed": 7}
    assert json.loads(text_of(events, "summary").strip("`\n")) == {"eval/loss": 2.5}


def test_logdir_and_composite_with_jsonl(tmp_path):
    logdir = tmp_path / "tb"
    tracker = build_tracker(
        [TensorboardTrackerConfig(logdir=str(logdir)), JsonlTrackerConfig()], tmp_path
    )
    assert isinstance(tracker, CompositeTracker)
    tracker.log({"train/loss": 1.0}, step=4)
    tracker.finish()
    assert [e.step for e in read_events(logdir).Scalars("train/loss")] == [4]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == 1.0


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith("tensorboard."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(MissingPackageError, match=r"pip install 'loomax\[tensorboard\]'"):
        TensorboardTrackerConfig().init(tmp_path)
    # checked up front too, in a list, without creating anything
    with pytest.raises(MissingPackageError, match=r"trainer.tracker type: tensorboard"):
        check_trackers(
            [JsonlTrackerConfig(), TensorboardTrackerConfig(logdir=str(tmp_path / "tb"))]
        )
    assert not (tmp_path / "tb").exists()


def test_installed_package_passes_the_check():
    check_trackers([JsonlTrackerConfig(), TensorboardTrackerConfig()])


def test_bad_flush_secs_names_the_key():
    with pytest.raises(ValueError, match="trainer.tracker.flush_secs"):
        TensorboardTrackerConfig(flush_secs=0)
