"""Resume-aware logs: after a resume from step S, each step is recorded once.

The interrupted attempt logs steps 1..12 (its last checkpoint: step 10); the resumed one
calls ``resume_from(10)`` and logs 11..14 again, with other values.
"""

from __future__ import annotations

import json
import time

from loomax.tracking import (
    CompositeTracker,
    JsonlTrackerConfig,
    TensorboardTrackerConfig,
    Tracker,
    WandbTrackerConfig,
    read_metrics,
)

from .conftest import offline_runs, read_events, read_jsonl, read_wandb_run

FIRST, RESUMED_AT, SECOND = range(1, 13), 10, range(11, 15)


def interrupted_then_resumed(make, *, finish_first: bool = True) -> None:
    first: Tracker = make()
    for step in FIRST:
        first.log({"train/loss": float(step)}, step=step)
    if finish_first:
        first.finish()
    second: Tracker = make()
    second.resume_from(RESUMED_AT)
    for step in SECOND:
        second.log({"train/loss": 100.0 + step}, step=step)
    second.finish()


EXPECTED = {s: float(s) for s in range(1, RESUMED_AT + 1)} | {s: 100.0 + s for s in SECOND}


def test_jsonl_keeps_one_record_per_step(tmp_path):
    # not finished: the first attempt was killed with its file open
    interrupted_then_resumed(lambda: JsonlTrackerConfig().init(tmp_path), finish_first=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in records] == sorted(EXPECTED.items())


def test_jsonl_merges_what_the_resumed_run_logs_at_its_first_step(tmp_path):
    """E.g. an eval at the start of the resumed run: the step keeps one record, with both."""
    first = JsonlTrackerConfig().init(tmp_path)
    for step in FIRST:
        first.log({"train/loss": float(step)}, step=step)
    second = JsonlTrackerConfig().init(tmp_path)
    second.resume_from(RESUMED_AT)
    second.log({"eval/loss": 5.0}, step=RESUMED_AT)
    second.log({"train/loss": 111.0}, step=11)
    second.finish()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [*range(1, RESUMED_AT + 1), 11]
    assert records[RESUMED_AT - 1] == {"step": 10, "train/loss": 10.0, "eval/loss": 5.0}


def test_jsonl_drops_a_line_cut_short_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 2.0}\n{"step": 3, "tr'
    )
    tracker = JsonlTrackerConfig().init(tmp_path)
    tracker.resume_from(2)
    tracker.log({"train/loss": 3.5}, step=3)
    tracker.finish()
    assert read_jsonl(path) == [
        {"step": 1, "train/loss": 1.0},
        {"step": 2, "train/loss": 2.0},
        {"step": 3, "train/loss": 3.5},
    ]


def test_a_new_record_never_joins_a_line_cut_short(tmp_path):
    """Without a resume (no checkpoint yet), the cut line stays alone and readers skip it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "tr')
    tracker = JsonlTrackerConfig().init(tmp_path)
    tracker.log({"train/loss": 1.5}, step=1)
    tracker.finish()
    assert read_metrics(path) == [{"step": 1, "train/loss": 1.5}]


def test_read_metrics_keeps_the_last_record_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 3, "a": 3}, {"step": 2, "a": 20}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_metrics(path) == [{"step": 1, "a": 1}, {"step": 2, "a": 20}, {"step": 3, "a": 3}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def next_second() -> None:
    """Event files are read in name order, and their names start with the second they were
    made in: let the resumed attempt's file sort after the first one's, as in a real restart."""
    time.sleep(1.01 - time.time() % 1)


def test_tensorboard_purges_the_steps_after_the_checkpoint(tmp_path):
    def make():
        next_second()
        return TensorboardTrackerConfig().init(tmp_path)

    interrupted_then_resumed(make)
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    events = read_events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == sorted(EXPECTED.items())


def test_composite_tells_every_tracker(tmp_path):
    def make():
        next_second()
        return CompositeTracker(
            [JsonlTrackerConfig().init(tmp_path), TensorboardTrackerConfig().init(tmp_path)]
        )

    interrupted_then_resumed(make)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == sorted(EXPECTED)
    assert [e.step for e in read_events(tmp_path / "tensorboard").Scalars("train/loss")] == sorted(
        EXPECTED
    )


def test_wandb_never_logs_a_step_the_run_already_has(wandb_offline, tmp_path):
    """wandb cannot replace logged steps (it drops a step below the run's last one): the
    resumed job continues after the last step the run has, 12, in the same run."""
    interrupted_then_resumed(lambda: WandbTrackerConfig().init(tmp_path / "run"))
    first, second = (read_wandb_run(p) for p in offline_runs(wandb_offline))
    assert first["id"] == second["id"]
    rows = [(r["_step"], r["train/loss"]) for r in first["history"] + second["history"]]
    assert rows == [(s, float(s)) for s in FIRST] + [(13, 113.0), (14, 114.0)]


def test_wandb_a_new_id_starts_from_any_step(wandb_offline, tmp_path):
    """The stored last step belongs to the run it was logged to, not to a newly chosen id."""
    run_dir = tmp_path / "run"
    first = WandbTrackerConfig(id="first").init(run_dir)
    first.log({"train/loss": 1.0}, step=5)
    first.finish()
    second = WandbTrackerConfig(id="second").init(run_dir)
    second.log({"train/loss": 2.0}, step=3)
    second.finish()
    runs = [read_wandb_run(p) for p in offline_runs(wandb_offline)]
    assert [(r["id"], [h["_step"] for h in r["history"]]) for r in runs] == [
        ("first", [5]),
        ("second", [3]),
    ]
