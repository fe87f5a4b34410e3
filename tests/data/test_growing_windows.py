"""Windows over a token cache still building: the order is the finished cache's, read as it grows.

Caches here are `memory://` (built in this process, one shard after another, no Ray), so a
build that fails at a given shard leaves exactly the shards before it in the ledger.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.data.growing_windows import GrowingWindows
from loomax.data.loader import BatchLoader
from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import (
    TokenCache,
    TokenCacheDamaged,
    TokenCacheError,
    build_token_cache,
)
from loomax.data.token_cache.partial import GrowingCache
from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.storage import Directory, to_url

NUM_SHARDS = 7
SEQ_LEN = 16
CHUNK = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Seven .jsonl shards of different sizes (one empty) and a BPE of them."""
    root = tmp_path_factory.mktemp("growing")
    texts = []
    for k in range(NUM_SHARDS):
        docs = (
            []
            if k == 4
            else [f"shard {k} doc {i}: " + "abc def " * (i % 5) for i in range(9 + 3 * k)]
        )
        (root / f"s{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts += docs
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(texts, 300, tokenizer)
    shards = source_shards(SourceConfig(urls=[str(root / f"s{{0..{NUM_SHARDS - 1}}}.jsonl")]))
    return SimpleNamespace(shards=shards, tokenizer=tokenizer)


def fail_from(position: int):
    def before_piece(shard) -> None:
        if shard.index >= position:
            raise RuntimeError("stops here on purpose")

    return before_piece


def build(corpus, url, **kwargs):
    return build_token_cache(corpus.shards, corpus.tokenizer, url, progress=False, **kwargs)


def windows(corpus, url, key, **kwargs) -> GrowingWindows:
    cache = GrowingCache(url, key, [s.name for s in corpus.shards])
    return GrowingWindows(cache, SEQ_LEN, CHUNK, "data.train[0]", poll_s=0.02, **kwargs)


def test_a_growing_cache_gives_the_finished_caches_batches(corpus, caplog):
    full_url, part_url = (f"memory://growing-{uuid.uuid4().hex[:8]}-{x}" for x in "fp")
    key = build(corpus, full_url).fingerprint
    with pytest.raises(TokenCacheError, match="on purpose"):
        build(
            corpus, part_url, before_piece=fail_from(5)
        )  # shards 0-4: chunks 0 and 1 (2 needs shard 5)
    full = windows(corpus, full_url, key)
    part = windows(corpus, part_url, key, chunk_memory_bytes=0, say_every_s=0.05)  # per window
    assert full.refresh() > part.refresh() > 0 and part.chunks_ready == 2 and full.complete
    full_loader = BatchLoader(full, 4, seed=3, prefetch=0)
    part_loader = BatchLoader(part, 4, seed=3, prefetch=0)

    # every window is the chunk's token stream cut in seq_len pieces, shards back to back
    flat = TokenCache.open(full_url)["train"].as_numpy()
    shard_tokens = [full.cache.tokens(p) for p in range(NUM_SHARDS)]
    ids = np.arange(len(full))
    got = full.get_batch(ids)
    expected = []
    for chunk in range(full.num_chunks):
        base = sum(shard_tokens[: chunk * CHUNK])
        size = sum(shard_tokens[p] for p in full.chunk_shards_of(chunk))
        expected += [
            flat[base + w * SEQ_LEN : base + (w + 1) * SEQ_LEN] for w in range(size // SEQ_LEN)
        ]
    np.testing.assert_array_equal(got, np.stack(expected))

    ready_steps = len(part) // 4
    for step in range(ready_steps):  # read from the pieces, window by window
        np.testing.assert_array_equal(part_loader.batch(step), full_loader.batch(step))
        np.testing.assert_array_equal(part_loader.locate(step)[1], full_loader.locate(step)[1])

    waiting = {}
    caplog.set_level(logging.INFO, logger="loomax.data.growing_windows")
    later = ready_steps + 1
    thread = threading.Thread(target=lambda: waiting.update(batch=part_loader.batch(later)))
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "a step past the built chunks waits for them"
    assert "waiting" in caplog.text and "5/7 shards tokenized" in caplog.text
    build(corpus, part_url)  # resumes: shards 5, 6, then the flat arrays; pieces deleted
    thread.join(30)
    assert not thread.is_alive()
    assert not Directory(part_url).child("pieces").keys()
    np.testing.assert_array_equal(waiting["batch"], full_loader.batch(later))
    epoch = len(full) // 4 + 1  # into the second epoch: wraps around once the size is known
    for step in [ready_steps, *range(later, 2 * epoch)]:  # now from the flat arrays
        np.testing.assert_array_equal(part_loader.batch(step), full_loader.batch(step))
    assert part.complete and len(part) == len(full)
    second = full_loader.epoch_order(1)
    assert sorted(second) == list(range(len(full))) and list(second) != list(
        full_loader.epoch_order(0)
    )


def test_a_failed_build_ends_the_wait_with_its_error(corpus):
    url = f"memory://growing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TokenCacheError) as failed:
        build(corpus, url, before_piece=fail_from(2))
    key = Directory(url).read_json("build.json")["fingerprint"]
    part = windows(corpus, url, key, failure=lambda: failed.value)
    assert part.refresh() > 0 and part.chunks_ready == 1
    with pytest.raises(TokenCacheError, match="on purpose"):
        part.sample_windows(0, np.arange(len(part) + 1), seed=0, shuffle=True)


def test_holding_out_the_first_chunks_tail_is_the_same_on_a_growing_cache(corpus):
    full_url, part_url = (f"memory://growing-{uuid.uuid4().hex[:8]}-{x}" for x in "fp")
    key = build(corpus, full_url).fingerprint
    with pytest.raises(TokenCacheError, match="on purpose"):
        build(corpus, part_url, before_piece=fail_from(3))  # chunk 0 only
    full, part = windows(corpus, full_url, key), windows(corpus, part_url, key)
    full.refresh(), part.refresh()
    assert full.complete and part.chunks_ready == 1
    first = full.first_chunk_windows
    tail = full.get_batch(np.arange(first - 2, first)).reshape(-1)
    np.testing.assert_array_equal(full.hold_out_first_chunk_tail(2), tail)
    np.testing.assert_array_equal(part.hold_out_first_chunk_tail(2), tail)
    assert part.first_chunk_windows == full.first_chunk_windows == first - 2
    full_loader = BatchLoader(full, 3, seed=5, prefetch=0)
    part_loader = BatchLoader(part, 3, seed=5, prefetch=0)
    held = {tuple(w) for w in tail.reshape(2, SEQ_LEN)}
    for step in range((first - 2) // 3):
        batch = part_loader.batch(step)
        np.testing.assert_array_equal(batch, full_loader.batch(step))
        assert not held & {tuple(w) for w in batch}, "a held-out window is trained on"
    build(corpus, part_url)
    steps = range((first - 2) // 3, 2 * len(full) // 3 + 1)
    for step in steps:
        np.testing.assert_array_equal(part_loader.batch(step), full_loader.batch(step))


def test_pieces_deleted_under_a_reader_are_read_from_the_flat_arrays(corpus):
    """The build finishes (and deletes the pieces) between a reader's look at the ledger and
    its reads: those go to the flat arrays, as `meta.json` now says they must."""
    url = f"memory://growing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TokenCacheError, match="on purpose"):
        build(corpus, url, before_piece=fail_from(3))
    key = Directory(url).read_json("build.json")["fingerprint"]
    cache = GrowingCache(url, key, [s.name for s in corpus.shards])
    assert sorted(cache.refresh()) == [0, 1, 2] and not cache.complete
    build(corpus, url)  # completes: flat arrays, meta.json, pieces deleted
    assert not Directory(url).child("pieces").keys() and not cache.complete
    got = cache.read([(1, 0, cache.tokens(1)), (2, 3, 9)])
    flat = TokenCache.open(url)["train"].as_numpy()
    start = cache.tokens(0)
    np.testing.assert_array_equal(got[0], flat[start : start + cache.tokens(1)])
    start += cache.tokens(1)
    np.testing.assert_array_equal(got[1], flat[start + 3 : start + 9])
    assert cache.complete


def test_a_wait_looks_at_a_local_ledger_often_and_at_an_object_store_less(tmp_path):
    """A fresh run's first step starts within LOCAL_POLL_S of its chunk on a local disk (a
    cheap listing); on gs:// or s3:// each look is a paid request, once a second."""
    from loomax.data.growing_windows import LOCAL_POLL_S, REMOTE_POLL_S
    from loomax.data.token_cache.partial import GrowingCache

    def poll(url: str) -> float:
        cache = GrowingCache(url, "key", ["a", "b"])
        return GrowingWindows(cache, 4, 1, "data.train[0]")._poll_s

    assert poll(str(tmp_path / "cache")) == poll("memory://cache") == LOCAL_POLL_S == 0.1
    assert poll("gs://bucket/cache") == REMOTE_POLL_S == 1.0


def test_a_source_cut_as_it_is_read_trains_while_its_cache_builds(corpus, caplog):
    """`records_per_shard`: the shards' number is unknown until the build reads the end of
    the stream. A reader of the half-built cache gives the finished cache's batches, says
    how far the build is without a total, and learns the end from the ledger."""
    from dataclasses import replace

    from loomax.data.record_shards import RecordShards

    source = replace(corpus.shards[0].source, records_per_shard=6)
    shards = 105 // 6 + 1  # 105 documents: 17 logical shards of 6, then one of 3

    def records(url, **kwargs):
        return build_token_cache(
            RecordShards(source), corpus.tokenizer, url, progress=False, **kwargs
        )

    def open_ended(url, key) -> GrowingWindows:
        cache = GrowingCache(url, key, RecordShards(source).names)
        return GrowingWindows(cache, SEQ_LEN, CHUNK, "data.train[0]", poll_s=0.02)

    full_url, part_url = (f"memory://records-{uuid.uuid4().hex[:8]}-{x}" for x in "fp")
    key = records(full_url).fingerprint
    with pytest.raises(TokenCacheError, match="on purpose"):
        records(part_url, before_piece=fail_from(7))  # shards 0-6: chunks 0-2
    full, part = open_ended(full_url, key), open_ended(part_url, key)
    assert full.refresh() > part.refresh() > 0
    assert full.complete and full.cache.num_shards == shards and full.num_chunks == 9
    assert part.chunks_ready == 3 and not part.complete and not part.cache.num_shards_known
    assert part.progress().startswith("7 shards tokenized (of a stream)")
    full_loader = BatchLoader(full, 4, seed=1, prefetch=0)
    part_loader = BatchLoader(part, 4, seed=1, prefetch=0)
    ready_steps = len(part) // 4
    for step in range(ready_steps):
        np.testing.assert_array_equal(part_loader.batch(step), full_loader.batch(step))
    records(part_url)  # the next run resumes the build: shards 7-17
    for step in range(ready_steps, 2 * (len(full) // 4) + 1):  # through a second epoch
        np.testing.assert_array_equal(part_loader.batch(step), full_loader.batch(step))
    assert part.complete and part.cache.num_shards == shards and len(part) == len(full)


def test_a_damaged_piece_is_refused_in_one_line_naming_it(corpus, tmp_path):
    """A piece of a cache still building whose byte was overwritten (its size kept, so only
    the chunk's checksum can tell) fails the read with `TokenCacheDamaged` naming the piece
    and the fix, as `TokenCache` does for a finished cache: not tensorstore's raw error."""
    url = to_url(tmp_path / "cache")
    with pytest.raises(TokenCacheError, match="on purpose"):
        build(corpus, url, before_piece=fail_from(3))
    key = Directory(url).read_json("build.json")["fingerprint"]
    part = windows(corpus, url, key)
    assert part.refresh() > 0 and not part.cache.complete
    attempt = part.cache.entries[1]["piece"]
    piece = tmp_path / "cache" / "pieces" / "1" / attempt / "train" / "tokens"
    [file] = [f for f in piece.rglob("*") if f.is_file() and f.name != "zarr.json"]
    data = bytearray(file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(TokenCacheDamaged, match=rf"{piece} is damaged \(") as error:
        part.get_batch(np.arange(len(part)))
    message = str(error.value)
    assert "\n" not in message and "tensorstore_spec" not in message
    assert f"delete {tmp_path / 'cache'} and rerun `loomax cache`" in message
    assert error.value.root == url
