"""The tracker contract: every registered ``trainer.tracker.type`` (and a list, the composite)
records what it is given, survives a second ``finish()``, and records nothing after finishing.

Each tracker is read back where it can be: jsonl lines and JSON files, TensorBoard event files,
wandb's offline run files (``WANDB_MODE=offline``). ``noop`` must write nothing at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from loomax.tracking import (
    CompositeTracker,
    JsonlTrackerConfig,
    NoopTrackerConfig,
    TensorboardTrackerConfig,
    Tracker,
    TrackerConfig,
    WandbTrackerConfig,
    build_tracker,
)

from .conftest import offline_runs, read_events, read_jsonl, read_wandb_run, text_of

HPARAMS = {"trainer.seed": 3, "model.hidden_dim": 32}
METRICS = {(1, "train/loss"): 2.5, (1, "optim/learning_rate"): 0.125, (2, "train/loss"): 2.0}
SUMMARY = {"eval/loss": 1.75}
ARTIFACT = "notes.json"

View = dict
"""What one sink of a tracker holds, read back: any of metrics, hparams, summary, artifacts."""


def jsonl_view(run_dir: Path) -> View:
    view: View = {"metrics": {}}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        step = record.pop("step")
        view["metrics"].update({(step, k): v for k, v in record.items()})
    for key, name in (("hparams", "hparams.json"), ("summary", "summary.json")):
        if (run_dir / name).exists():
            view[key] = json.loads((run_dir / name).read_text())
    return view


def tensorboard_view(run_dir: Path) -> View:
    events = read_events(run_dir / "tensorboard")
    tags = events.Tags()
    view: View = {
        "metrics": {(e.step, t): e.value for t in tags["scalars"] for e in events.Scalars(t)},
        "artifacts": sorted(t.removeprefix("artifacts/") for t in tags["tensors"] if "/" in t),
    }
    for key, tag in (("hparams", "config"), ("summary", "summary")):
        if tag in tags["tensors"]:
            view[key] = json.loads(text_of(events, tag).strip("`\n"))
    return view


def wandb_view(run_dir: Path) -> View:
    (run_files,) = offline_runs(run_dir.parent / "wandb-dir" / "wandb")
    run = read_wandb_run(run_files)
    metrics = {}
    for row in run["history"]:
        metrics.update({(row["_step"], k): v for k, v in row.items() if not k.startswith("_")})
    hparams = {
        f"{section}.{k}": v
        for section in ("trainer", "model")
        for k, v in run["config"].get(section, {}).items()
    }
    return {
        "metrics": metrics,
        "hparams": hparams,
        "summary": {k: v for k, v in run["summary"].items() if not k.startswith("_")},
        "artifacts": [a["name"] for a in run["artifacts"]],
    }


@dataclass(frozen=True)
class Case:
    config: TrackerConfig | list[TrackerConfig]
    views: Callable[[Path], list[View]]
    """What each sink holds; [] for a tracker with nothing to read (the run dir stays empty)."""


CASES = {
    "jsonl": Case(JsonlTrackerConfig(), lambda d: [jsonl_view(d)]),
    "tensorboard": Case(TensorboardTrackerConfig(), lambda d: [tensorboard_view(d)]),
    "wandb": Case(WandbTrackerConfig(project="contract"), lambda d: [wandb_view(d)]),
    "noop": Case(NoopTrackerConfig(), lambda d: []),
    "composite": Case(
        [JsonlTrackerConfig(), TensorboardTrackerConfig()],
        lambda d: [jsonl_view(d), tensorboard_view(d)],
    ),
}


def test_every_registered_tracker_is_in_the_contract():
    covered = {
        TrackerConfig.get_choice_name(type(c.config))
        for c in CASES.values()
        if isinstance(c.config, TrackerConfig)
    }
    assert covered == set(TrackerConfig.get_known_choices()) == set(CASES) - {"composite"}


@pytest.fixture(params=sorted(CASES))
def case(request, wandb_offline) -> Case:  # wandb offline for every case: nothing goes online
    return CASES[request.param]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


def start(case: Case, run_dir: Path) -> Tracker:
    tracker = build_tracker(case.config, run_dir)
    assert isinstance(tracker, CompositeTracker) == isinstance(case.config, list)
    return tracker


def record_everything(tracker: Tracker, run_dir: Path) -> None:
    tracker.log_hyperparameters(HPARAMS)
    tracker.log({"train/loss": np.float32(2.5), "optim/learning_rate": 0.125}, step=1)
    tracker.log({"train/loss": 2.0}, step=2)
    tracker.log_summary(SUMMARY)
    artifact = run_dir / ARTIFACT
    artifact.parent.mkdir(parents=True, exist_ok=True)
    artifact.write_text("{}")
    tracker.log_artifact(artifact, name=ARTIFACT, type="notes")


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()} if path.exists() else set()


def test_records_what_it_is_given_and_reads_back(case, run_dir):
    tracker = start(case, run_dir)
    record_everything(tracker, run_dir)
    tracker.finish()
    views = case.views(run_dir)
    if not views:
        assert files_under(run_dir) == {run_dir / ARTIFACT}  # only the test's own file
    for view in views:
        assert view["metrics"] == pytest.approx(METRICS)
        assert view.get("hparams", HPARAMS) == HPARAMS
        assert view.get("summary", SUMMARY).items() >= SUMMARY.items()  # wandb adds last values
        assert view.get("artifacts", [ARTIFACT]) == [ARTIFACT]


def test_finish_twice_is_safe(case, run_dir):
    tracker = start(case, run_dir)
    tracker.log({"train/loss": 2.0}, step=2)
    tracker.finish()
    tracker.finish()
    for view in case.views(run_dir):
        assert view["metrics"] == {(2, "train/loss"): 2.0}


AFTER_FINISH = {
    "log": lambda t, _: t.log({"train/loss": 9.0}, step=9),
    "log_summary": lambda t, _: t.log_summary({"late": 1.0}),
    "log_hyperparameters": lambda t, _: t.log_hyperparameters({"late": 1}),
    "log_artifact": lambda t, path: t.log_artifact(path, name="late.json"),
}


@pytest.mark.parametrize("call", AFTER_FINISH)
def test_nothing_is_recorded_after_finish(case, run_dir, call, request):
    """After ``finish()`` a call either raises or is ignored: what was recorded stays as it was."""
    tracker = start(case, run_dir)
    tracker.log({"train/loss": 2.0}, step=2)
    tracker.finish()
    before = case.views(run_dir), files_under(run_dir)
    late = run_dir / "late.json"
    late.parent.mkdir(parents=True, exist_ok=True)
    late.write_text("{}")
    try:
        AFTER_FINISH[call](tracker, late)
    except Exception:
        return  # raising is one of the two allowed answers
    assert (case.views(run_dir), files_under(run_dir)) == (before[0], before[1] | {late})


def test_after_finish_every_call_answers_alike(case, run_dir, request):
    """Every call after ``finish()`` raises, or every call is ignored: not some of each."""
    tracker = start(case, run_dir)
    tracker.finish()
    late = run_dir / "late.json"
    late.parent.mkdir(parents=True, exist_ok=True)
    late.write_text("{}")
    raised = set()
    for call in AFTER_FINISH.values():
        try:
            call(tracker, late)
            raised.add(False)
        except Exception:
            raised.add(True)
    assert len(raised) == 1
