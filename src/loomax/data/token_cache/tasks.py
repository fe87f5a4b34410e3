"""One shard into one piece: the job a Ray task (or this process, for memory://) runs.

A task reads its shard, tokenizes it in batches, writes the documents of each split to a
piece of its own (`pieces/<i>/<attempt>/<split>/`), and only then records the shard in
the ledger (`ledger/<i>.json`), so a ledger entry always names a complete piece. The
entry also names the Ray node that did the work (`node`, None outside Ray) and the encoder
(`encoder`: `tiktoken` where `fast_encoder` is exact, else `tokenizers`; the same ids)
and the niceness it ran at (`nice`, and `autogroup_nice`: its autogroup's, or None).
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts
from tokenizers import Tokenizer

from loomax.data.fast_encoder import FastEncoder, fast_encoder
from loomax.data.sources import ReadStats, Shard, read_shard
from loomax.data.token_cache.layout import create_array, is_held_out, piece_dir, split_names
from loomax.data.token_cache.lease import fence_holds
from loomax.data.token_cache.priority import autogroup_nice, set_task_priority
from loomax.data.tokenizer import encode_documents
from loomax.storage import Directory

_ENCODE_BATCH = 1024
"""Documents a task reads before encoding them in one batch."""

FLUSH_TOKENS = 1 << 22
"""Tokens a task buffers before appending them to its piece."""


@dataclass(frozen=True)
class PieceJob:
    """What a task needs to tokenize one shard into a piece and record it in the ledger."""

    position: int
    shard: Shard
    root_url: str
    fingerprint: str
    tokenizer_sha256: str
    bos_id: int | None
    max_documents: int | None
    holdout_fraction: float
    holdout_seed: int
    skip_bad_records: bool
    before_piece: Callable[[Shard], None] | None = None
    """Called with the shard in the task before it is read (see `build_token_cache`)."""
    documents: tuple[str, ...] | None = None
    """The shard's documents, read by the driver (a logical shard of `RecordShards`); None =
    the task reads the shard itself."""
    skipped: int = 0
    """Bad records the driver skipped while reading `documents`."""
    fast_encoder: bool = True
    """Encode with `fast_encoder.fast_encoder` where it is exact (the same ids either way)."""
    nice: int = 0
    """Niceness a Ray task adds to its worker process (once per process) and gives its Ray
    node's autogroup before tokenizing (`priority.set_task_priority`)."""
    driver_autogroup: str | None = None
    """`priority.autogroup_id()` of the process that started the build (None: unknown)."""
    fence: int | None = None
    """The fence of the build lease the build runs under (None: no lease): the task records
    its shard only while the lease still holds it (`lease.fence_holds`)."""


class FenceLost(RuntimeError):
    """The build lease no longer holds the task's fence: its builder stopped or was replaced,
    so the task recorded nothing (its piece, if written, is deleted)."""


FENCE_LOST = "fence_lost"
"""The key of what a task returns instead of a ledger entry when its fence was lost (a
value, not an exception: a stopped driver no longer waits for its tasks, and Ray logs the
errors nobody fetched)."""


@functools.lru_cache(maxsize=4)
def _tokenizer(sha256: str, text: str) -> Tokenizer:
    """The tokenizer of a tokenizer.json's text, parsed once per process."""
    return Tokenizer.from_str(text)


@functools.lru_cache(maxsize=4)
def _fast_encoder(sha256: str, text: str) -> FastEncoder | None:
    """The exact fast encoder of a tokenizer.json's text, or None; made once per process."""
    return fast_encoder(_tokenizer(sha256, text))


def build_piece(job: PieceJob, tokenizer_json: str) -> dict[str, Any]:
    """Tokenizes one shard into a new piece, then records it in the ledger; returns the entry
    (`{FENCE_LOST: why}` instead when the build lease no longer holds `job.fence`).

    A shard already recorded for this build is not tokenized again: its entry is returned.
    (Ray reruns a task lost with its node, and the node may have died after the task
    recorded its shard; the entry names a complete piece.)"""
    root = Directory(job.root_url)
    recorded = root.child("ledger").read_json(f"{job.position}.json")
    if recorded and (recorded.get("fingerprint"), recorded.get("name")) == (
        job.fingerprint,
        job.shard.name,
    ):
        return recorded
    if not fence_holds(job.root_url, job.fence):
        return {FENCE_LOST: f"shard {job.shard.name}: the build lease moved on; not tokenized"}
    if job.before_piece is not None:
        job.before_piece(job.shard)
    set_task_priority(job.nice, job.driver_autogroup)  # `_run_here` clears nice: the driver
    _match_threads_to_cpus()
    tokenizer = _tokenizer(job.tokenizer_sha256, tokenizer_json)
    fast = _fast_encoder(job.tokenizer_sha256, tokenizer_json) if job.fast_encoder else None
    bos = np.array([] if job.bos_id is None else [job.bos_id], dtype=np.int32)
    attempt = uuid.uuid4().hex[:12]  # a task left running by a killed driver writes elsewhere
    writers = {
        split: PieceWriter(piece_dir(root, job.position, attempt, split))
        for split in split_names(job.holdout_fraction)
    }
    stats = ReadStats(skipped=job.skipped)
    documents = (
        iter(job.documents)
        if job.documents is not None
        else read_shard(job.shard, skip_bad_records=job.skip_bad_records, stats=stats)
    )
    index = 0
    for batch in _batched(itertools.islice(documents, job.max_documents), _ENCODE_BATCH):
        for tokens in encode_documents(tokenizer, batch, fast=fast):
            held_out = is_held_out(job.position, index, job.holdout_fraction, job.holdout_seed)
            writers["validation" if held_out else "train"].append(
                np.concatenate((bos, tokens)) if len(bos) else tokens
            )
            index += 1
    entry = {
        "position": job.position,
        "name": job.shard.name,
        "fingerprint": job.fingerprint,
        "piece": attempt,
        "documents": index,
        "skipped": stats.skipped,
        "skipped_examples": stats.examples,
        "splits": {split: writer.close() for split, writer in writers.items()},
        "node": _ray_node_id(),
        "encoder": "tokenizers" if fast is None else "tiktoken",
        "nice": os.nice(0),
        "autogroup_nice": autogroup_nice(),
    }
    if not fence_holds(job.root_url, job.fence):  # a stale holder's task writes no entry
        root.child("pieces", str(job.position), attempt).delete()
        return {FENCE_LOST: f"shard {job.shard.name}: the build lease moved on; not recorded"}
    root.child("ledger").write_json(f"{job.position}.json", entry)  # after the piece; atomic
    return entry


def _match_threads_to_cpus() -> None:
    """In a Ray worker, gives the tokenizer (rayon) this node's cores / its Ray CPUs threads,
    unless `RAYON_NUM_THREADS` is set: rayon's default, one thread per core in every
    worker, runs N workers x cores threads. Must run before the first encode here."""
    ray = sys.modules.get("ray")
    if "RAYON_NUM_THREADS" in os.environ or ray is None or not ray.is_initialized():
        return
    node = ray.get_runtime_context().get_node_id()
    cpus = next((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == node), 1)
    os.environ["RAYON_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, int(cpus))))


def _ray_node_id() -> str | None:
    """The id of the Ray node this runs on; None outside a Ray worker (e.g. memory:// builds)."""
    ray = sys.modules.get("ray")  # a Ray worker has imported it; importing it here costs seconds
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class PieceWriter:
    """Appends documents to one split of a piece: tokens (grown as needed), then offsets."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._tokens: ts.TensorStore | None = None
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._written = 0
        self._lengths: list[int] = []

    def append(self, document: np.ndarray) -> None:
        """Adds one document's tokens; they are written once enough are buffered."""
        self._buffer.append(document)
        self._buffered += len(document)
        self._lengths.append(len(document))
        if self._buffered >= FLUSH_TOKENS:
            self._flush()

    def close(self) -> dict[str, int]:
        """Writes what is buffered and the offsets; returns the split's counts."""
        self._flush()
        if self._tokens is None:
            create_array(self._directory.child("tokens"), "int32", 0)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        create_array(self._directory.child("offsets"), "int64", len(offsets)).write(
            offsets
        ).result()
        return {"documents": len(self._lengths), "tokens": self._written}

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = np.concatenate(self._buffer)
        end = self._written + len(data)
        if self._tokens is None:  # sized by the first write, so small pieces get small chunks
            self._tokens = create_array(self._directory.child("tokens"), "int32", end)
        else:
            self._tokens = self._tokens.resize(exclusive_max=[end]).result()
        self._tokens[self._written : end].write(data).result()
        self._written = end
        self._buffer, self._buffered = [], 0
