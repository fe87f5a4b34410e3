"""What a token cache depends on (its settings and fingerprint), and what a build made."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomax.data.cache import file_sha256, fingerprint
from loomax.data.record_shards import RecordShards
from loomax.data.sources import Shard, source_fingerprint
from loomax.data.token_cache.layout import FORMAT_VERSION
from loomax.data.tokenizer import resolve_tokenizer_path
from loomax.storage import Directory


@dataclass(frozen=True)
class SplitInfo:
    """Size of one split of a cache."""

    documents: int
    tokens: int


@dataclass(frozen=True)
class TokenCacheInfo:
    """What `build_token_cache` made, or found already made."""

    url: str
    """The cache's kvstore URL."""
    fingerprint: str
    """Digest of the settings the cache was built with (`cache_fingerprint`)."""
    splits: dict[str, SplitInfo]
    """Documents and tokens per split."""
    documents_skipped: int
    """Bad records skipped (`skip_bad_records`) in the shards used."""
    shards_total: int
    """Shards given to the build."""
    shards_used: int
    """Leading shards whose documents are in the cache (fewer when `max_documents` caps it)."""
    shards_tokenized: int
    """Shards tokenized by this call: 0 when the cache was complete, fewer than all on resume."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first bad records skipped, each `file, line N: reason`."""
    shard_documents: dict[str, int] = field(default_factory=dict)
    """Documents of each shard used, by shard name (a cut last shard counts all of its own)."""
    nodes: dict[str, int] = field(default_factory=dict)
    """Shards tokenized by this call per Ray node id (empty when built in this process)."""

    @property
    def empty_shards(self) -> list[str]:
        """The shards used that hold no documents (e.g. empty files)."""
        return [name for name, documents in self.shard_documents.items() if documents == 0]


def cache_settings(
    shards: Sequence[Shard],
    tokenizer_path: str | os.PathLike,
    *,
    max_documents: int | None = None,
    holdout_fraction: float = 0.0,
    holdout_seed: int = 0,
    bos: bool = False,
) -> dict[str, Any]:
    """Everything the cache's contents depend on, as a JSON record.

    Sources are identified by `source_fingerprint` (config and files' size and mtime),
    the tokenizer by its file's SHA-256. `skip_bad_records` is not part of it: a shard
    that was read without error has the same tokens either way.
    """
    streamed = isinstance(shards, RecordShards)  # its shards cannot be listed: its rule is
    names = [shards.description] if streamed else [shard.name for shard in shards]
    sources: dict[str, str] = {}  # each source once, in order of first use
    for shard in shards[:1] if streamed else shards:
        key = json.dumps(dataclasses.asdict(shard.source), sort_keys=True, default=str)
        if key not in sources:
            sources[key] = source_fingerprint(shard.source)
    return {
        "format": FORMAT_VERSION,
        "tokenizer_sha256": file_sha256(resolve_tokenizer_path(tokenizer_path)),
        "shards": names,
        "sources": list(sources.values()),
        "max_documents": max_documents,
        "holdout": {"fraction": holdout_fraction, "seed": holdout_seed},
        "bos": bos,
    }


def cache_fingerprint(
    shards: Sequence[Shard],
    tokenizer_path: str | os.PathLike,
    *,
    max_documents: int | None = None,
    holdout_fraction: float = 0.0,
    holdout_seed: int = 0,
    bos: bool = False,
) -> str:
    """A short digest of `cache_settings`: name the cache folder with it to keep builds apart."""
    return fingerprint(
        cache_settings(
            shards,
            tokenizer_path,
            max_documents=max_documents,
            holdout_fraction=holdout_fraction,
            holdout_seed=holdout_seed,
            bos=bos,
        )
    )


@dataclass(frozen=True)
class BuildPlan:
    """The fixed inputs of one build, shared by its steps."""

    root: Directory
    shards: Sequence[Shard]
    settings: dict[str, Any]
    """`cache_settings` of this build."""
    key: str
    """Its fingerprint: ledger entries and `build.json` of other settings do not count."""
    tokenizer_file: Path
    token_ids: dict[str, int | None]
    """`vocab_size`, `eos_id` and `bos_id` (None without `bos`), recorded in meta.json."""
    skip_bad_records: bool
    fast_encoder: bool = True
    """Whether tasks may encode with the exact tiktoken encoder (not a setting: same tokens)."""
    background_from: int | None = None
    """Shards from this position on are tokenized by Ray tasks at `BACKGROUND_NICE`."""
    fence: int | None = None
    """The fence of the build lease this build runs under (None: no lease); its tasks
    record their shards only while the lease holds it."""

    @property
    def max_documents(self) -> int | None:
        return self.settings["max_documents"]

    @property
    def holdout(self) -> dict[str, Any]:
        return self.settings["holdout"]

    def shards_used(self, ledger: dict[int, dict]) -> int | None:
        """How many leading shards the cache holds, once the ledger tells; None while unknown."""
        documents = 0
        for position in range(len(self.shards)):
            if position not in ledger:
                return None
            documents += ledger[position]["documents"]
            if self.max_documents is not None and documents >= self.max_documents:
                return position + 1
        return len(self.shards)
