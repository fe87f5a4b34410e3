"""trainer.write_artifact: saved in the run directory and logged to the tracker."""

from __future__ import annotations

import json
from pathlib import Path

import optax

from loomax.tracking import JsonlTrackerConfig, TensorboardTrackerConfig, WandbTrackerConfig
from loomax.train import Trainer, TrainerConfig

from .conftest import offline_runs, read_wandb_run


def make_trainer(run_dir: Path) -> Trainer:
    trackers = [JsonlTrackerConfig(), WandbTrackerConfig(), TensorboardTrackerConfig()]
    config = TrainerConfig(run_dir=str(run_dir), tracker=trackers, progress_bar=False)
    return Trainer(config, optax.sgd(0.1), lambda model, batch, key=None: (0.0, 1.0))


def test_artifacts_are_saved_and_logged(wandb_offline, tmp_path):
    trainer = make_trainer(tmp_path / "run")
    source = tmp_path / "vocab.txt"
    source.write_text("a\nb\n")
    table = trainer.write_artifact("eval_table.json", {"loss": [2.0, 1.5]}, type="eval")
    text = trainer.write_artifact("sample.txt", "def f():")
    copied = trainer.write_artifact("vocab.txt", source)
    trainer.finish()

    artifacts = tmp_path / "run" / "artifacts"
    assert table == artifacts / "eval_table.json"
    assert json.loads(table.read_text()) == {"loss": [2.0, 1.5]}
    assert text.read_text() == "def f():" and copied.read_text() == "a\nb\n"
    run = read_wandb_run(offline_runs(wandb_offline)[0])
    assert sorted(a["name"] for a in run["artifacts"]) == [
        "eval_table.json",
        "sample.txt",
        "vocab.txt",
    ]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert "artifacts/eval_table.json" in events.Tags()["tensors"]
