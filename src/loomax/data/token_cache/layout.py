"""Where a token cache keeps what, and the arrays it keeps it in.

Layout under the cache URL (a local path or any tensorstore kvstore URL; `<i>` is a
shard's position in the list given to the build):

    build.json                      settings and fingerprint, written when a build starts
    ledger/<i>.json                 shard i is done: its counts and the name of its piece
    pieces/<i>/<attempt>/<split>/   shard i's `tokens` and `offsets`; deleted at the end
    <split>/tokens                  int32 [num_tokens]: the split's documents in order,
                                    each followed by EOS (and preceded by BOS if `bos`)
    <split>/offsets                 int64 [num_documents + 1]: document d is
                                    tokens[offsets[d]:offsets[d + 1]]
    meta.json                       written last: the cache is complete when it exists;
                                    it lists the files of the splits (and their sizes)

The splits are `train`, and `validation` when `holdout_fraction > 0`: a document is
held out when a hash of (shard position, index in the shard, seed) falls below the
fraction (`is_held_out`), so the split does not depend on how the shards were scheduled
nor on where their files lie (a copy of the files elsewhere splits the same way).
"""

from __future__ import annotations

import hashlib
from typing import Any

import tensorstore as ts

from loomax.errors import UserError
from loomax.storage import CONTEXT, Directory

FORMAT_VERSION = 3
"""Bump when the layout or meaning of the cache changes, so old caches are refused.

2: the validation hold-out hashes the shard's position, not its name (a path).
3: every chunk carries a CRC-32C, missing chunks fail reads, meta.json lists the files."""

META_FILE = "meta.json"
"""Written last; marks the cache as complete and records what it holds."""

BUILD_FILE = "build.json"
"""Written when a build starts: the settings that pieces and ledger entries belong to."""

SHARD_TOKENS = 1 << 22
"""Tokens per stored file (zarr3 shard) of a token array: 16 MiB before compression."""

READ_CHUNK = 1 << 16
"""Tokens per separately readable chunk inside a stored file (256 KiB)."""


class TokenCacheError(UserError, RuntimeError):
    """A token cache that cannot be built or read: incomplete, built otherwise, or a shard failed."""


class TokenCacheDamaged(TokenCacheError):
    """A file of a token cache is truncated, overwritten or missing; `root` is the cache's URL."""

    def __init__(self, message: str, root: str) -> None:
        super().__init__(message)
        self.root = root


def split_names(holdout_fraction: float) -> tuple[str, ...]:
    """The splits of a cache: `train`, and `validation` when documents are held out."""
    return ("train", "validation") if holdout_fraction > 0 else ("train",)


def is_held_out(position: int, index: int, fraction: float, seed: int = 0) -> bool:
    """Whether document `index` of the shard at `position` (in the build's list) goes to validation.

    True when a 64-bit hash of (seed, position, index) is below `fraction` of its range:
    deterministic, independent per document, independent of scheduling, and independent
    of the shard's name, so the same files under another directory split the same way.
    """
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{position}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def piece_dir(root: Directory, position: int, attempt: str, split: str) -> Directory:
    """Where attempt `attempt` of shard `position` keeps its `split`."""
    return root.child("pieces", str(position), attempt, split)


# ---------------------------------------------------------------------- arrays
def array_spec(url: str, dtype: str | None = None, size: int | None = None) -> dict[str, Any]:
    """A zarr3 spec for a 1-D array at `url`; with `dtype` and `size`, its metadata to create."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": url.rstrip("/") + "/",
        "store_data_equal_to_fill_value": True,  # token 0 is a real token: store every chunk
        "fill_missing_data_reads": False,  # so a missing chunk fails instead of reading zeros
    }
    if dtype is None:
        return spec
    fits = _next_power_of_two(max(size or 0, 1))
    read_chunk = min(READ_CHUNK, fits)
    # a stored file no larger than the array needs: its index has an entry per inner
    # chunk, so a 90-element array in a 4M-element file wrote a 32,768-entry index
    stored = max(read_chunk, min(SHARD_TOKENS, fits))
    spec["metadata"] = {
        "shape": [size],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [stored]}},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [read_chunk],
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "zstd", "configuration": {"level": 1}},
                        {"name": "crc32c"},  # an overwritten byte fails the read
                    ],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                },
            }
        ],
    }
    return spec


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def create_array(directory: Directory, dtype: str, size: int) -> ts.TensorStore:
    """A new 1-D array of `size` elements, replacing any array already there."""
    spec = array_spec(directory.url, dtype, size)
    return ts.open(spec, create=True, delete_existing=True, context=CONTEXT).result()


def open_array(directory: Directory) -> ts.TensorStore:
    """The existing 1-D array in `directory`."""
    return ts.open(array_spec(directory.url), open=True, context=CONTEXT).result()
