"""The Ray-built token cache: equal to single-process tokenization, resumable, fingerprinted.

Every build runs on one real local Ray cluster (2 CPUs, conftest's `ray_cluster`), and writes
real tensorstore files under tmp_path.
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import (
    TokenCache,
    TokenCacheError,
    assemble,
    build_token_cache,
    cache_fingerprint,
    is_held_out,
    layout,
    tasks,
)
from loomax.data.tokenizer import encode_documents, load_tokenizer, train_bpe_tokenizer
from loomax.storage import Directory

pytestmark = pytest.mark.slow

NUM_SHARDS = 6
DRIVER = Path(__file__).with_name("token_cache_driver.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six .jsonl shards of different sizes, their documents, and a BPE tokenizer of them."""
    root = tmp_path_factory.mktemp("corpus")
    documents: list[list[str]] = []
    for k in range(NUM_SHARDS):
        shard = [
            f"shard {k}, doc {i}: " + "héllo wörld, " * (i % 7) + f"x = {i * k}\n"
            for i in range(15 + 4 * k)
        ]
        lines = "".join(json.dumps({"text": text}) + "\n" for text in shard)
        (root / f"shard_{k}.jsonl").write_text(lines, encoding="utf-8")
        documents.append(shard)
    tokenizer_path = root / "tokenizer.json"
    train_bpe_tokenizer([d for shard in documents for d in shard], 300, tokenizer_path)
    source = SourceConfig(urls=[str(root / f"shard_{{0..{NUM_SHARDS - 1}}}.jsonl")])
    return SimpleNamespace(
        source=source,
        shards=source_shards(source),
        documents=documents,
        tokenizer=tokenizer_path,
        encoded=[encode_documents(load_tokenizer(tokenizer_path), shard) for shard in documents],
    )


def build(corpus, cache: Path, **kwargs):
    return build_token_cache(corpus.shards, corpus.tokenizer, cache, progress=False, **kwargs)


def assert_split(cache: TokenCache, split: str, documents: list[np.ndarray]) -> None:
    """The split holds exactly `documents`, in order, with matching offsets."""
    tokens = cache[split]
    expected = np.concatenate(documents) if documents else np.zeros(0, np.int32)
    assert tokens.num_documents == len(documents)
    assert tokens.num_tokens == len(expected)
    got = tokens.as_numpy()
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(tokens.offsets(), np.cumsum([0] + [len(d) for d in documents]))


def ledger_times(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (cache / "ledger").glob("*.json")}


def test_cache_equals_single_process_tokenization(ray_cluster, corpus, tmp_path):
    info = build(corpus, tmp_path / "cache")
    everything = [doc for shard in corpus.encoded for doc in shard]
    cache = TokenCache.open(tmp_path / "cache")
    assert list(cache.splits) == ["train"]
    assert_split(cache, "train", everything)
    np.testing.assert_array_equal(cache["train"].document(17), everything[17])
    np.testing.assert_array_equal(cache["train"].read(5, 40), np.concatenate(everything)[5:40])
    assert info.splits["train"].documents == len(everything)
    assert (info.shards_total, info.shards_used, info.shards_tokenized) == (6, 6, 6)
    assert not (tmp_path / "cache" / "pieces").exists()

    again = build(corpus, tmp_path / "cache")  # complete: found, nothing tokenized
    assert again.shards_tokenized == 0 and again.fingerprint == info.fingerprint


def test_a_streamed_source_is_fed_to_ray_tasks_as_it_is_read(ray_cluster, corpus, tmp_path):
    """Logical shards of 10 records (`records_per_shard`): the driver reads the stream as
    Ray takes the tasks; the cache holds the listed files' documents, with the holdout
    split by logical shard."""
    from dataclasses import replace

    from loomax.data.record_shards import RecordShards

    shards = RecordShards(replace(corpus.source, records_per_shard=10))
    info = build_token_cache(
        shards, corpus.tokenizer, tmp_path / "cache", progress=False, holdout_fraction=0.2
    )
    everything = [doc for shard in corpus.encoded for doc in shard]  # 150 documents
    assert (info.shards_total, info.shards_tokenized) == (16, 16)  # the last one empty
    held = [is_held_out(i // 10, i % 10, 0.2) for i in range(len(everything))]
    cache = TokenCache.open(tmp_path / "cache")
    assert_split(cache, "train", [d for d, h in zip(everything, held, strict=True) if not h])
    assert_split(cache, "validation", [d for d, h in zip(everything, held, strict=True) if h])


def test_holdout_and_bos_match_a_reference(ray_cluster, corpus, tmp_path):
    tokenizer = load_tokenizer(corpus.tokenizer)
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    bos = tokenizer.token_to_id("<s>")
    build_token_cache(
        corpus.shards,
        tmp_path / "tokenizer.json",
        tmp_path / "cache",
        holdout_fraction=0.3,
        holdout_seed=7,
        bos=True,
        progress=False,
    )
    train, validation = [], []
    for position, documents in enumerate(corpus.documents):
        for index, tokens in enumerate(encode_documents(tokenizer, documents)):
            held_out = is_held_out(position, index, 0.3, seed=7)
            (validation if held_out else train).append(np.concatenate(([bos], tokens)))
    assert 0.15 < len(validation) / (len(train) + len(validation)) < 0.45
    cache = TokenCache.open(tmp_path / "cache")
    assert_split(cache, "train", train)
    assert_split(cache, "validation", validation)
    assert cache.meta["bos_id"] == bos

    with pytest.raises(ValueError, match="no beginning-of-document token"):
        build(corpus, tmp_path / "no-bos", bos=True)  # refused before any work


def test_max_documents_keeps_the_first_documents_in_global_order(ray_cluster, corpus, tmp_path):
    # shards hold 15, 19, 23, ... documents: 40 ends inside the third shard
    info = build(corpus, tmp_path / "cache", max_documents=40, holdout_fraction=0.25)
    first = [
        (position, index, tokens)
        for position, encoded in enumerate(corpus.encoded)
        for index, tokens in enumerate(encoded)
    ][:40]
    cache = TokenCache.open(tmp_path / "cache")
    for split, held_out in (("train", False), ("validation", True)):
        expected = [t for p, i, t in first if is_held_out(p, i, 0.25) == held_out]
        assert_split(cache, split, expected)
    assert info.shards_used == 3


def test_memory_store_is_built_in_process_with_tiny_chunks(corpus, tmp_path, monkeypatch):
    # tiny flushes, chunks and files, so pieces grow in many writes and arrays span many files
    monkeypatch.setattr(tasks, "FLUSH_TOKENS", 50)
    monkeypatch.setattr(layout, "SHARD_TOKENS", 128)
    monkeypatch.setattr(layout, "READ_CHUNK", 16)
    monkeypatch.setattr(assemble, "COPY_WINDOW", 1)
    url = f"memory://{tmp_path.name}"  # no Ray: its workers cannot see this process's memory
    info = build(corpus, url, holdout_fraction=0.2)
    assert info.url == url and info.shards_tokenized == NUM_SHARDS
    cache = TokenCache.open(url)
    train, validation = [], []
    for position, encoded in enumerate(corpus.encoded):
        for index, tokens in enumerate(encoded):
            (validation if is_held_out(position, index, 0.2) else train).append(tokens)
    assert_split(cache, "train", train)
    assert_split(cache, "validation", validation)


def test_killed_build_resumes_to_the_same_cache(ray_cluster, corpus, tmp_path):
    reference = tmp_path / "reference"
    build(corpus, reference)
    cache = tmp_path / "cache"
    args = {
        "urls": corpus.source.urls,
        "tokenizer": str(corpus.tokenizer),
        "cache": str(cache),
        "address": ray_cluster.address,
        "sleep": 0.4,  # per shard, so the driver is killed with shards left to do
    }
    driver = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(args)])
    try:
        wait_for(lambda: len(ledger_times(cache)) >= 2 or driver.poll() is not None, 60)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.wait()
    assert driver.returncode == -signal.SIGKILL, "the build ended before it was killed"
    wait_for_quiet_ledger(cache)  # tasks of the killed driver may finish before Ray ends them
    before = ledger_times(cache)
    assert 2 <= len(before) < NUM_SHARDS and not (cache / "meta.json").exists()
    with pytest.raises(TokenCacheError, match="no meta.json"):
        TokenCache.open(cache)

    info = build(corpus, cache)
    assert info.shards_tokenized == NUM_SHARDS - len(before)
    assert {k: v for k, v in ledger_times(cache).items() if k in before} == before
    assert_same_cache(cache, reference)


def test_failed_task_resumes_to_the_same_cache(ray_cluster, corpus, tmp_path):
    reference = tmp_path / "reference"
    build(corpus, reference, holdout_fraction=0.2)
    cache = tmp_path / "cache"
    failing = corpus.shards[3].name
    with pytest.raises(TokenCacheError, match=f"shard {failing} failed.*fails on purpose"):
        build(corpus, cache, holdout_fraction=0.2, before_piece=fail_on(failing))
    before = ledger_times(cache)
    assert "3.json" not in before and len(before) >= 3

    info = build(corpus, cache, holdout_fraction=0.2)
    assert info.shards_tokenized == NUM_SHARDS - len(before)
    assert {k: v for k, v in ledger_times(cache).items() if k in before} == before
    assert_same_cache(cache, reference)


def test_a_rerun_task_returns_its_recorded_shard_and_tokenizes_nothing(corpus, tmp_path):
    """Ray reruns a task lost with its node, which may have died after recording its shard:
    the rerun returns that entry (same piece) instead of tokenizing the shard again."""
    import dataclasses

    from loomax.data.token_cache.tasks import PieceJob, build_piece

    url = f"memory://{tmp_path.name}-rerun"
    build(corpus, url)
    recorded = Directory(url).child("ledger").read_json("0.json")
    job = PieceJob(
        position=0, shard=corpus.shards[0], root_url=url, fingerprint=recorded["fingerprint"],
        tokenizer_sha256="", bos_id=None, max_documents=None, holdout_fraction=0.0,
        holdout_seed=0, skip_bad_records=False, before_piece=fail_on(corpus.shards[0].name),
    )  # fmt: skip
    assert build_piece(job, corpus.tokenizer.read_text()) == recorded  # before_piece not called
    other = dataclasses.replace(job, fingerprint="other settings")
    with pytest.raises(RuntimeError, match="fails on purpose"):  # not this build's: tokenized
        build_piece(other, corpus.tokenizer.read_text())


def test_a_cache_of_the_old_split_rule_is_refused(corpus, tmp_path):
    """Format 1 held documents out by a hash of the shard's path: such a cache is not reused."""
    url = f"memory://{tmp_path.name}-old"
    build(corpus, url, holdout_fraction=0.2)
    root = Directory(url)
    meta = root.read_json("meta.json")
    old = meta | {
        "format": 1,
        "fingerprint": "format-1",
        "settings": meta["settings"] | {"format": 1},
    }
    root.write_json("meta.json", old)
    with pytest.raises(TokenCacheError, match=r"has format 1, this version reads 3; rebuild"):
        TokenCache.open(url)
    with pytest.raises(TokenCacheError, match=r"other settings \(format: cache 1, now 3\)"):
        build(corpus, url, holdout_fraction=0.2)
    assert build(corpus, url, holdout_fraction=0.2, overwrite=True).shards_tokenized == NUM_SHARDS
    assert TokenCache.open(url).meta["format"] == 3


def test_other_settings_are_refused_or_overwritten(ray_cluster, corpus, tmp_path):
    cache = tmp_path / "cache"
    build(corpus, cache, holdout_fraction=0.1)
    with pytest.raises(
        TokenCacheError, match=rf"{re.escape(str(cache))} was built with other settings.*holdout"
    ):
        build(corpus, cache, holdout_fraction=0.2)
    with pytest.raises(TokenCacheError, match=r"shards: 6 entries, now 5"):
        build_token_cache(corpus.shards[:5], corpus.tokenizer, cache, progress=False)

    info = build(corpus, cache, holdout_fraction=0.2, overwrite=True)
    assert info.shards_tokenized == NUM_SHARDS
    assert TokenCache.open(cache).meta["settings"]["holdout"]["fraction"] == 0.2
    assert info.fingerprint == cache_fingerprint(
        corpus.shards, corpus.tokenizer, holdout_fraction=0.2
    )

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a cache")
    with pytest.raises(TokenCacheError, match="holds no token cache"):
        build(corpus, tmp_path / "other", overwrite=True)


def test_bad_records_fail_the_build_or_are_skipped_and_counted(ray_cluster, corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n{"text": "also fine"}\n', encoding="utf-8")
    shards = corpus.shards[:2] + source_shards(SourceConfig(urls=[str(bad)]))
    cache = tmp_path / "cache"
    with pytest.raises(TokenCacheError, match=r"bad\.jsonl, line 2: invalid JSON"):
        build_token_cache(shards, corpus.tokenizer, cache, progress=False)

    info = build_token_cache(shards, corpus.tokenizer, cache, skip_bad_records=True, progress=False)
    assert info.documents_skipped == 1 and info.shards_tokenized == 1
    meta = TokenCache.open(cache).meta
    assert meta["documents_skipped"] == 1 and "line 2" in meta["skipped_examples"][0]
    expected = corpus.encoded[0] + corpus.encoded[1]
    expected += encode_documents(load_tokenizer(corpus.tokenizer), ["fine", "also fine"])
    assert_split(TokenCache.open(cache), "train", expected)


def test_holdout_hash_is_deterministic_and_near_the_fraction():
    picks = [is_held_out(2, i, 0.1, seed=3) for i in range(5000)]
    assert picks == [is_held_out(2, i, 0.1, seed=3) for i in range(5000)]
    assert 0.08 < sum(picks) / 5000 < 0.12
    assert picks != [is_held_out(2, i, 0.1, seed=4) for i in range(5000)]
    assert picks != [is_held_out(3, i, 0.1, seed=3) for i in range(5000)]  # shards differ
    assert not any(is_held_out(2, i, 0.0) for i in range(100))


def test_opening_a_missing_cache_names_it(tmp_path):
    with pytest.raises(
        TokenCacheError, match=rf"{re.escape(str(tmp_path / 'nothing'))} has no meta.json"
    ):
        TokenCache.open(tmp_path / "nothing")


# ---------------------------------------------------------------------- helpers
def fail_on(name: str):
    """A `before_piece` that fails the task of shard `name`.

    A closure, so Ray pickles it by value: workers need not import this test module.
    """

    def before_piece(shard) -> None:
        if shard.name == name:
            raise RuntimeError(f"shard {shard.name} fails on purpose")

    return before_piece


def assert_same_cache(cache: Path, reference: Path) -> None:
    """Both caches hold the same splits, tokens, offsets and meta."""
    got, want = TokenCache.open(cache), TokenCache.open(reference)
    assert got.meta == want.meta
    for split in want.splits:
        np.testing.assert_array_equal(got[split].as_numpy(), want[split].as_numpy())
        np.testing.assert_array_equal(got[split].offsets(), want[split].offsets())
    assert not (cache / "pieces").exists()


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def wait_for_quiet_ledger(cache: Path, quiet: float = 1.5) -> None:
    """Waits until no ledger entry has appeared for `quiet` seconds."""
    seen, since = ledger_times(cache), time.monotonic()
    while time.monotonic() - since < quiet:
        time.sleep(0.1)
        now = ledger_times(cache)
        if now != seen:
            seen, since = now, time.monotonic()


def test_ray_workers_tokenize_on_their_share_of_the_cores(ray_cluster):
    """A worker's tokenizer gets its node's cores / Ray CPUs threads (the head has 2 CPUs),
    not one per core in every worker."""
    import os

    import ray

    from loomax.data.token_cache.tasks import _match_threads_to_cpus

    def threads() -> tuple[str, int]:
        os.environ.pop("RAYON_NUM_THREADS", None)  # as a worker of an unset driver starts
        _match_threads_to_cpus()
        return os.environ["RAYON_NUM_THREADS"], os.cpu_count() or 1

    got, cores = ray.get(ray.remote(threads).remote())
    assert got == str(max(1, cores // 2))
