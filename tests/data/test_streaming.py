"""`data.stream_while_building`: a run that starts on a cache still building trains on the
batches of a run on the finished cache, with bitwise the same losses.

The cache is `memory://`, built in this process (on a background thread, one shard after
another, no Ray); each shard past the first chunk is slowed down so the run starts first.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from loomax.checkpoint import list_checkpoints
from loomax.config import ConfigError, parse_config
from loomax.data.dataset import build_caches
from loomax.data.run_tokenizer import prepare_tokenizer
from loomax.data.token_cache import build as build_module
from loomax.lm import TrainLmConfig
from loomax.train_lm import train_lm

NUM_SHARDS = 8
DRIVER = Path(__file__).with_name("streaming_train_driver.py")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    for k in range(NUM_SHARDS):
        docs = [f"def f{k}_{i}(a):\n    return a * {i} + {k}\n" for i in range(40)]
        (root / f"part_{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(root / f"part_{{0..{NUM_SHARDS - 1}}}.jsonl")


@pytest.fixture(scope="module")
def finished_losses(tmp_path_factory, shards) -> list[float]:
    """The losses of the tiny run on a cache built whole before it starts: what the runs
    on a building cache (test 1) and the killed-and-resumed run (test 3) must equal. One
    run serves both."""
    tmp_path = tmp_path_factory.mktemp("finished")
    finished = config(tmp_path, shards, f"memory://finished-{uuid.uuid4().hex[:8]}", "run")
    build_caches(finished.data, prepare_tokenizer(finished.data), progress=False)
    assert train_lm(finished).final.step == 12
    return losses(tmp_path, "run")


def config(tmp_path, shards, cache: str, run: str, *extra: str, **source) -> TrainLmConfig:
    return parse_config(
        TrainLmConfig, None, arguments(tmp_path, shards, cache, run, *extra, **source)
    )


def arguments(tmp_path, shards, cache: str, run: str, *extra: str, **source) -> list[str]:
    """The command-line overrides of the tiny run `run` on the cache under `cache`
    (`source`: more settings of the train source)."""
    args = {
        "data.train": json.dumps([{"urls": [shards], **source}]),
        "data.tokenizer_vocab_size": "300",
        "data.validation_fraction": "0.1",
        "data.cache_dir": cache,
        "data.stream_while_building": "auto",  # streams: the files hold more than 1 kB
        "data.stream_auto_mb": "0.001",
        "data.stream_chunk_shards": "2",
        "model.seq_len": "32",
        "model.hidden_dim": "32",
        "model.num_layers": "1",
        "model.num_heads": "2",
        "trainer.train_batch_size": "8",
        "trainer.num_train_steps": "12",
        "trainer.log_every": "1",
        "trainer.steps_per_eval": "100",
        "trainer.run_dir": str(tmp_path / run),
        "trainer.progress_bar": "false",
        "sample.enabled": "false",
    }
    return [x for k, v in args.items() for x in (f"--{k}", v)] + list(extra)


def losses(tmp_path, run: str) -> list[float]:
    lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    return [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]


@pytest.mark.slow
def test_a_run_on_a_building_cache_has_the_finished_caches_losses(
    tmp_path, shards, monkeypatch, caplog, finished_losses
):
    slow = build_module.build_piece

    def slowed(job, tokenizer_json):
        if job.position >= 2:  # the first chunk is quick, the rest come while training
            time.sleep(0.4)
        return slow(job, tokenizer_json)

    monkeypatch.setattr(build_module, "build_piece", slowed)
    caplog.set_level(logging.INFO)
    cache = f"memory://stream-{uuid.uuid4().hex[:8]}"
    building = config(tmp_path, shards, cache, "building")
    first = train_lm(building)
    started = [r.getMessage() for r in caplog.records if "training starts on" in r.getMessage()]
    assert started and f"{NUM_SHARDS}/{NUM_SHARDS} shards" not in started[0], started
    assert any("waiting" in r.getMessage() for r in caplog.records), (
        "the run caught up with the build"
    )

    assert first.final.step == 12
    assert losses(tmp_path, "building") == finished_losses
    assert len(losses(tmp_path, "building")) == 12


def test_a_source_read_as_one_stream_trains_while_its_cache_builds(
    tmp_path, shards, monkeypatch, caplog
):
    """`records_per_shard` (a source too large to list, cut into logical shards as the
    build reads it): a run starts before the build knows how many shards there are and
    trains on the batches, and losses, of a run on the finished cache."""
    slow = build_module.build_piece
    monkeypatch.setattr(
        build_module,
        "build_piece",
        lambda job, tok: (time.sleep(0.3) if job.position >= 2 else None) or slow(job, tok),
    )
    cache = f"memory://records-{uuid.uuid4().hex[:8]}"
    streamed = dict(records_per_shard=30)  # 320 documents: 10 shards of 30, one of 20
    building = config(tmp_path, shards, cache, "building", **streamed)
    caplog.set_level(logging.INFO, logger="loomax.data.streaming")
    caplog.set_level(logging.INFO, logger="loomax.train_lm")
    train_lm(building)
    [order] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data order")]
    assert "training while the token caches build" in order and "read as a stream" in order
    [started] = [r.getMessage() for r in caplog.records if "training starts on" in r.getMessage()]
    assert "(of a stream)" in started, started  # before the build knew how many shards
    monkeypatch.setattr(build_module, "build_piece", slow)
    [info], _ = build_caches(building.data, prepare_tokenizer(building.data), progress=False)
    assert info.shards_total == 11
    train_lm(config(tmp_path, shards, cache, "finished", **streamed))
    assert losses(tmp_path, "building") == losses(tmp_path, "finished")
    assert len(losses(tmp_path, "building")) == 12


@pytest.mark.slow
def test_a_run_killed_while_the_cache_builds_resumes_to_the_uninterrupted_losses(
    tmp_path, shards, finished_losses
):
    """A streaming run (a real process, building the cache as it trains) is SIGKILLed after
    its step-4 checkpoint, mid-build; a run resumed from that checkpoint takes the build
    over and trains steps 5-12 with bitwise the losses of an uninterrupted run on the
    finished cache (so the same batches), as the killed run's steps did."""
    cache = str(tmp_path / "cache")
    keep = ("--trainer.checkpointer.fixed_steps", "[4]", "--trainer.checkpointer.async_save")

    def driver(run: str, sleep: float, *extra: str, **stall: float) -> subprocess.Popen:
        args = arguments(tmp_path, shards, cache, run, *keep, "false", *extra)
        options = json.dumps({"args": args, "sleep": sleep, **stall})
        return subprocess.Popen([sys.executable, str(DRIVER), options])

    # 3 s per shard past the first chunk, then stalled from chunk 2 (shards 4 and 5): chunks
    # 0 and 1 hold 76 windows, 9 steps of 8, so the run is killed mid-build at step 9 or
    # before, however late the kill comes on a loaded machine
    killed = driver("killed", 3.0, stall_from=4, stall=120.0)
    try:
        deadline = time.monotonic() + 240
        checkpoints = str(tmp_path / "killed" / "checkpoints")
        while not any(c.step == 4 for c in list_checkpoints(checkpoints)):
            assert killed.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no step-4 checkpoint"
            time.sleep(0.1)
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.wait()
    assert killed.returncode == -signal.SIGKILL
    [tokens] = (p for p in (tmp_path / "cache" / "tokens").glob("train0-*") if p.is_dir())
    done = len(list((tokens / "ledger").glob("*.json")))
    assert not (tokens / "meta.json").exists() and done < NUM_SHARDS, "killed mid-build"

    resumed = driver(
        "resumed",
        0.0,
        "--trainer.load_checkpoint",
        "true",
        "--trainer.load_checkpoint_path",
        checkpoints,
    )
    assert resumed.wait(300) == 0
    assert (tokens / "meta.json").exists(), "the resumed run finished the build"
    expected = finished_losses  # an uninterrupted run's, on a cache built whole first
    assert losses(tmp_path, "resumed") == expected[4:]
    logged = losses(tmp_path, "killed")  # those written out before the kill (steps 5-9
    assert len(logged) <= 9 and logged == expected[: len(logged)]  # may run before it lands)


def test_epochs_are_refused_while_streaming(tmp_path, shards):
    with pytest.raises(ConfigError, match="num_train_steps"):
        train_lm(
            config(
                tmp_path,
                shards,
                "memory://never",
                "epochs",
                "--trainer.num_train_epochs",
                "1",
                "--data.stream_while_building",
                "true",
            )  # fmt: skip
        )
