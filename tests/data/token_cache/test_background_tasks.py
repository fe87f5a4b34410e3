"""A streaming build's background shards on Ray: niced, and held to leave a core free.

Builds run on the run's shared 2-CPU Ray cluster (conftest's `ray_cluster`).
"""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.data.token_cache.build import BACKGROUND_NICE, BuildStopped
from loomax.data.token_cache.priority import autogroup_id, autogroup_nice
from loomax.data.tokenizer import train_bpe_tokenizer

pytestmark = pytest.mark.slow

NUM_SHARDS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six small .jsonl shards and a BPE tokenizer of them."""
    root = tmp_path_factory.mktemp("background")
    documents = [f"shard {k}, doc {i}: x = {i * k}\n" for k in range(NUM_SHARDS) for i in range(8)]
    for k in range(NUM_SHARDS):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in documents[k * 8 : k * 8 + 8])
        (root / f"shard_{k}.jsonl").write_text(lines, encoding="utf-8")
    train_bpe_tokenizer(documents, 300, root / "tokenizer.json")
    source = SourceConfig(urls=[str(root / f"shard_{{0..{NUM_SHARDS - 1}}}.jsonl")])
    return SimpleNamespace(shards=source_shards(source), tokenizer=root / "tokenizer.json")


def build(corpus, cache, **kwargs):
    return build_token_cache(corpus.shards, corpus.tokenizer, cache, progress=False, **kwargs)


def test_shards_past_background_from_run_nice_on_ray_never_here(
    ray_cluster, corpus, tmp_path, autogroups
):
    """A streaming run's build past its first chunk yields the cores: its Ray tasks run at
    BACKGROUND_NICE, and start only once the first chunk's tasks have ended (they share the
    Ray node's autogroup, whose nice each sets); a build in this process (a memory:// cache)
    never renices the driver."""
    starts = tmp_path / "starts"
    starts.mkdir()

    def record_start(shard) -> None:  # a closure: pickled by value to the tasks
        (starts / Path(shard.name).name).write_text(str(time.time()))

    build(corpus, tmp_path / "cache", background_from=4, before_piece=record_start)
    ledger_files = [tmp_path / "cache" / "ledger" / f"{i}.json" for i in range(NUM_SHARDS)]
    ledger = [json.loads(p.read_text()) for p in ledger_files]
    assert [e["nice"] >= BACKGROUND_NICE for e in ledger[4:]] == [True, True]
    first_chunk_end = max(p.stat().st_mtime for p in ledger_files[:4])  # each task's last write
    background_start = min(float((starts / f"shard_{k}.jsonl").read_text()) for k in (4, 5))
    assert background_start >= first_chunk_end
    before = os.nice(0)
    own_group = autogroup_nice()  # None in the default group (a CI container's entry point)
    if autogroup_id() is not None:  # Linux with autogroups: the Ray head is a session of its own
        # niceness counts only inside an autogroup: the Ray node's group is niced too ...
        if autogroups.group_nice_settable():
            assert [e["autogroup_nice"] for e in ledger[4:]] == [BACKGROUND_NICE] * 2
        build(corpus, tmp_path / "foreground")  # ... and set back by the next plain build
        entries = [
            json.loads(p.read_text()) for p in (tmp_path / "foreground" / "ledger").iterdir()
        ]
        assert {e["autogroup_nice"] for e in entries} == {0}
        assert autogroup_nice() == own_group  # the driver's group is never touched
    else:
        assert {e["autogroup_nice"] for e in ledger} == {None}
    build(corpus, "memory://nice-cache", background_from=0)
    assert os.nice(0) == before


def test_held_background_shards_run_one_at_a_time(ray_cluster, corpus, tmp_path):
    """While `held()`, the tasks past `background_from` leave a core free: on the 2-CPU
    cluster, no two of them (nor one and a first-chunk task) run at once."""
    spans_dir = tmp_path / "spans"
    spans_dir.mkdir()

    def record(shard) -> None:  # a closure: pickled by value to the tasks
        start = time.time()
        time.sleep(0.4)
        (spans_dir / Path(shard.name).name).write_text(f"{start} {time.time()}")

    build(corpus, tmp_path / "cache", background_from=2, held=lambda: True, before_piece=record)
    spans = {
        int(p.stem.removeprefix("shard_")): tuple(map(float, p.read_text().split()))
        for p in spans_dir.iterdir()
    }
    assert sorted(spans) == list(range(NUM_SHARDS))
    first_chunk_end = max(spans[0][1], spans[1][1])
    background = sorted(spans[k] for k in range(2, NUM_SHARDS))  # by start
    assert background[0][0] >= first_chunk_end
    assert all(b[0] >= a[1] for a, b in zip(background, background[1:], strict=False))


def test_a_stopped_build_cancels_no_task_those_running_record_their_shards(
    ray_cluster, corpus, tmp_path
):
    """Stopping a build starts no new task and cancels none (a `ray.cancel` racing a task's
    reply can abort the driver on Ray 2.60): the shards running at the stop are recorded."""
    started = tmp_path / "started"
    started.mkdir()

    def slow(shard) -> None:  # a closure: pickled by value to the tasks
        (started / Path(shard.name).name).write_text("")
        time.sleep(1.5)

    ledger = tmp_path / "cache" / "ledger"
    at_stop: dict[str, set[str]] = {}

    def should_stop() -> bool:
        names = {p.stem for p in started.iterdir()}
        if names and not at_stop:
            recorded = {p.stem for p in ledger.glob("*.json")} if ledger.exists() else set()
            at_stop.update(started=names, recorded=recorded)
        return bool(names)

    with pytest.raises(BuildStopped):
        build(corpus, tmp_path / "cache", before_piece=slow, should_stop=should_stop)
    running = at_stop["started"] - {f"shard_{p}" for p in at_stop["recorded"]}
    assert running  # shards were mid-task when the build stopped
    deadline = time.time() + 30
    while time.time() < deadline:
        names = {p.stem for p in started.iterdir()}
        done = {json.loads(p.read_text())["name"] for p in ledger.glob("*.json")}
        if names <= {Path(d).stem for d in done}:
            break
        time.sleep(0.2)
    done = {Path(json.loads(p.read_text())["name"]).stem for p in ledger.glob("*.json")}
    assert running <= done  # they finished and recorded their shards
    assert len(done) < NUM_SHARDS  # and the build did not go on past the tasks in flight
