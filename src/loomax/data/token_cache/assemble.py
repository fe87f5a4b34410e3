"""Assembly: the pieces of the shards used, copied into one flat array per split.

Each piece lands at its global offset, so the result does not depend on the order the
shards were tokenized in. With `max_documents` the last shard used may be cut short.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import tensorstore as ts

from loomax.data.token_cache.layout import (
    create_array,
    is_held_out,
    open_array,
    piece_dir,
    split_names,
)
from loomax.data.token_cache.settings import BuildPlan
from loomax.storage import Directory

COPY_WINDOW = 8
"""Shards whose pieces are copied into the flat arrays at the same time."""


def assemble_splits(
    build: BuildPlan, entries: list[dict], check: Callable[[], None] = lambda: None
) -> dict[str, dict[str, int]]:
    """Writes every split from the pieces of `entries` (the ledger entries of the shards
    used, in order); returns the documents and tokens of each split. `check` is called
    before each write (the build's lease fence: it raises when the lease is lost)."""
    kept = _kept_counts(build, entries)
    splits = {}
    for split in split_names(build.holdout["fraction"]):
        counts = [shard_counts[split] for shard_counts in kept]
        _assemble_split(build.root, split, entries, counts, check)
        splits[split] = {
            "documents": sum(c["documents"] for c in counts),
            "tokens": sum(c["tokens"] for c in counts),
        }
    return splits


def _kept_counts(build: BuildPlan, entries: list[dict]) -> list[dict[str, dict[str, int]]]:
    """Documents and tokens per split that each shard contributes (the last may be cut)."""
    if build.max_documents is None:
        return [entry["splits"] for entry in entries]
    kept, remaining = [], build.max_documents
    for entry in entries:
        if entry["documents"] <= remaining:
            kept.append(entry["splits"])
        else:
            kept.append(_cut_counts(build, entry, remaining))
        remaining -= min(remaining, entry["documents"])
    return kept


def _cut_counts(build: BuildPlan, entry: dict, documents: int) -> dict[str, dict[str, int]]:
    """The per-split counts of the first `documents` documents of a shard."""
    fraction, seed = build.holdout["fraction"], build.holdout["seed"]
    held_out = sum(is_held_out(entry["position"], i, fraction, seed) for i in range(documents))
    counts = {}
    for split, split_documents in (("train", documents - held_out), ("validation", held_out)):
        if split in entry["splits"]:
            offsets = open_array(_piece(build.root, entry, split).child("offsets"))
            tokens = int(offsets[split_documents].read().result())
            counts[split] = {"documents": split_documents, "tokens": tokens}
    return counts


def _piece(root: Directory, entry: dict, split: str) -> Directory:
    return piece_dir(root, entry["position"], entry["piece"], split)


def _assemble_split(
    root: Directory, split: str, entries: list[dict], counts: list[dict], check: Callable[[], None]
) -> None:
    """Writes `<split>/tokens` and `<split>/offsets` from the pieces, each at its global offset."""
    check()
    num_documents = sum(c["documents"] for c in counts)
    tokens = create_array(root.child(split, "tokens"), "int32", sum(c["tokens"] for c in counts))
    offsets = create_array(root.child(split, "offsets"), "int64", num_documents + 1)
    offsets[0].write(0).result()
    pending: deque[ts.WriteFutures] = deque()
    doc_base = token_base = 0
    for entry, count in zip(entries, counts, strict=True):
        n_docs, n_tokens = count["documents"], count["tokens"]
        if n_docs == 0:
            continue
        piece = _piece(root, entry, split)
        check()
        source = open_array(piece.child("tokens"))[:n_tokens]
        pending.append(tokens[token_base : token_base + n_tokens].write(source))
        piece_offsets = open_array(piece.child("offsets"))[1 : n_docs + 1].read().result()
        pending.append(
            offsets[doc_base + 1 : doc_base + n_docs + 1].write(piece_offsets + token_base)
        )
        while len(pending) > 2 * COPY_WINDOW:
            pending.popleft().result()
        doc_base += n_docs
        token_base += n_tokens
    for write in pending:
        write.result()
