"""One cache, many runs: the build lease, a second builder that waits, a killed builder replaced.

The lease and the two-builder tests use `memory://` caches (built in this process, no Ray).
The kill test runs a builder in a process of its own and kills it mid-shard; both it and
the run that takes over build shard by shard in their process, as `memory://` builds do
(`token_cache_driver.in_process_builds`): what is tested is the lease and the ledger
around the tokenizing (a Ray build killed mid-way is `test_token_cache.py`'s).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.data.growing_windows import GrowingWindows
from loomax.data.loader import BatchLoader
from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import TokenCache, build_token_cache
from loomax.data.token_cache import build as build_module
from loomax.data.token_cache.lease import BuildLease
from loomax.data.token_cache.partial import GrowingCache
from loomax.data.token_cache.shared import build_shared
from loomax.data.tokenizer import train_bpe_tokenizer

NUM_SHARDS = 6
DRIVER = Path(__file__).with_name("token_cache_driver.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lease")
    texts = []
    for k in range(NUM_SHARDS):
        docs = [f"shard {k} doc {i}: " + "lorem ipsum " * (i % 6) for i in range(20 + 5 * k)]
        (root / f"s{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts += docs
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(texts, 300, tokenizer)
    source = SourceConfig(urls=[str(root / f"s{{0..{NUM_SHARDS - 1}}}.jsonl")])
    return SimpleNamespace(source=source, shards=source_shards(source), tokenizer=tokenizer)


def test_the_lease_is_taken_once_renewed_and_taken_over_when_expired():
    url = f"memory://lease-{uuid.uuid4().hex[:8]}/tokens/train0-key"
    first, second = BuildLease(url, ttl_s=0.3, owner="a"), BuildLease(url, ttl_s=0.3, owner="b")
    assert first.acquire() and not second.acquire()
    assert first.holder()["owner"] == "a" and first.renew() and not second.acquire()
    time.sleep(0.4)  # a's lease expires unrenewed: b takes it over, a learns it lost it
    assert second.acquire() and second.holder()["owner"] == "b"
    assert not first.renew() and first.lost.is_set()
    first.release()  # not a's any more: nothing happens
    assert second.holder()["owner"] == "b"
    second.release()
    assert second.holder() is None and first.acquire() and not first.lost.is_set()


def test_two_runs_on_one_cache_tokenize_each_shard_once(corpus, monkeypatch):
    slow = build_module.build_piece
    tokenized: list[int] = []

    def counted(job, tokenizer_json):
        tokenized.append(job.position)
        time.sleep(0.05)
        return slow(job, tokenizer_json)

    monkeypatch.setattr(build_module, "build_piece", counted)
    url = f"memory://lease-{uuid.uuid4().hex[:8]}/tokens/train0"
    infos: list = [None, None]

    def run(i: int) -> None:
        infos[i] = build_shared(
            corpus.shards, corpus.tokenizer, url, progress=False, lease_ttl_s=5, poll_s=0.05
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(tokenized) == list(range(NUM_SHARDS)), "every shard tokenized exactly once"
    assert sorted(info.shards_tokenized for info in infos) == [0, NUM_SHARDS]
    assert infos[0].splits == infos[1].splits
    assert BuildLease(url).holder() is None  # released


def test_a_builder_killed_mid_shard_is_replaced_and_the_batches_are_unchanged(
    corpus, tmp_path, monkeypatch
):
    spec = importlib.util.spec_from_file_location("token_cache_driver", DRIVER)
    driver_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver_module)
    driver_module.in_process_builds(monkeypatch.setattr)
    reference = tmp_path / "reference"
    key = build_token_cache(corpus.shards, corpus.tokenizer, reference, progress=False).fingerprint
    cache = tmp_path / "tokens" / "train0"
    args = {
        "urls": corpus.source.urls,
        "tokenizer": str(corpus.tokenizer),
        "cache": str(cache),
        "address": None,
        "sleep": 0.5,  # per shard: killed while a shard is mid-way
        "lease_ttl": 2.0,
        "in_process": True,
    }
    driver = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(args)])
    ledger = cache / "ledger"
    try:
        deadline = time.monotonic() + 60
        while len(list(ledger.glob("*.json"))) < 2 and driver.poll() is None:
            assert time.monotonic() < deadline, "the builder recorded no shards"
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.wait()
    assert driver.returncode == -signal.SIGKILL, "the build ended before it was killed"
    assert BuildLease(str(cache)).holder()["pid"] == driver.pid  # left behind, expiring
    recorded = len(list(ledger.glob("*.json")))
    assert 2 <= recorded < NUM_SHARDS and not (cache / "meta.json").exists()

    def windows(url) -> GrowingWindows:
        growing = GrowingCache(url, key, [s.name for s in corpus.shards])
        return GrowingWindows(growing, 8, 2, "data.train[0]", poll_s=0.05)

    full, part = windows(reference), windows(cache)
    full.refresh()
    full_loader = BatchLoader(full, 4, seed=1, prefetch=0)
    steps = 2 * len(full) // 4 + 1
    expected = [full_loader.batch(step) for step in range(steps)]

    info = build_shared(
        corpus.shards,
        corpus.tokenizer,
        cache,
        progress=False,
        lease_ttl_s=2.0,
        poll_s=0.1,
    )
    assert info.shards_tokenized == NUM_SHARDS - recorded  # the killed builder's shards kept
    assert (
        TokenCache.open(cache)["train"].num_tokens == TokenCache.open(reference)["train"].num_tokens
    )
    np.testing.assert_array_equal(
        TokenCache.open(cache)["train"].as_numpy(), TokenCache.open(reference)["train"].as_numpy()
    )
    assert BuildLease(str(cache)).holder() is None  # taken over, then released
    part.refresh()
    part_loader = BatchLoader(part, 4, seed=1, prefetch=0)
    for step in range(steps):
        np.testing.assert_array_equal(part_loader.batch(step), expected[step])
