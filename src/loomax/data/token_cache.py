"""The token cache: documents tokenized in parallel by Ray into flat tensorstore arrays.

`build_token_cache` tokenizes each shard in a Ray task, which writes the shard's tokens
to a piece of its own and then records the shard in the ledger. Once the ledger holds
every shard needed, the driver copies the pieces into one flat array per split and
writes `meta.json` last. An interrupted build (driver killed, a task failed) resumes
from the ledger: rerunning it tokenizes only the shards the ledger lacks, and the result
is the same, token for token. `TokenCache.open` reads a finished cache.

Layout under the cache URL (a local path or any tensorstore kvstore URL; `<i>` is a
shard's position in the list given to the build):

    build.json                      settings and fingerprint, written when a build starts
    ledger/<i>.json                 shard i is done: its counts and the name of its piece
    pieces/<i>/<attempt>/<split>/   shard i's `tokens` and `offsets`; deleted at the end
    <split>/tokens                  int32 [num_tokens]: the split's documents in order,
                                    each followed by EOS (and preceded by BOS if `bos`)
    <split>/offsets                 int64 [num_documents + 1]: document d is
                                    tokens[offsets[d]:offsets[d + 1]]
    meta.json                       written last: the cache is complete when it exists

The splits are `train`, and `validation` when `holdout_fraction > 0`: a document is
held out when a hash of (shard name, index in the shard, seed) falls below the fraction
(`is_held_out`), so the split does not depend on how the shards were scheduled.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
from tokenizers import Tokenizer
from tqdm import tqdm

from loomax.checkpoint.storage import CONTEXT, Directory, display, join, local_path, to_url
from loomax.data.cache import file_sha256, fingerprint
from loomax.data.sources import ReadStats, Shard, read_shard, source_fingerprint
from loomax.data.tokenizer import bos_id, encode_documents, eos_id, resolve_tokenizer_path
from loomax.distributed import RayConfig, ray_session
from loomax.errors import UserError

FORMAT_VERSION = 1
"""Bump when the layout or meaning of the cache changes, so old caches are refused."""

META_FILE = "meta.json"
"""Written last; marks the cache as complete and records what it holds."""

BUILD_FILE = "build.json"
"""Written when a build starts: the settings that pieces and ledger entries belong to."""

_SHARD_TOKENS = 1 << 22
"""Tokens per stored file (zarr3 shard) of a token array: 16 MiB before compression."""

_READ_CHUNK = 1 << 16
"""Tokens per separately readable chunk inside a stored file (256 KiB)."""

_ENCODE_BATCH = 1024
"""Documents a task reads before encoding them in one batch."""

_FLUSH_TOKENS = 1 << 22
"""Tokens a task buffers before appending them to its piece."""

_COPY_WINDOW = 8
"""Shards whose pieces are copied into the flat arrays at the same time."""

_TEST_HOOK_ENV = "LOOMAX_TOKEN_CACHE_TEST_HOOK"
"""Tests only: a folder whose `sleep` file (seconds) slows every shard task, and whose
`fail-once` file (a shard name) makes that shard's task raise once."""


class TokenCacheError(UserError, RuntimeError):
    """A token cache that cannot be built or read: incomplete, built otherwise, or a shard failed."""


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


# ---------------------------------------------------------------------- settings
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
    sources: dict[str, str] = {}  # each source once, in order of first use
    for shard in shards:
        key = json.dumps(dataclasses.asdict(shard.source), sort_keys=True, default=str)
        if key not in sources:
            sources[key] = source_fingerprint(shard.source)
    return {
        "format": FORMAT_VERSION,
        "tokenizer_sha256": file_sha256(resolve_tokenizer_path(tokenizer_path)),
        "shards": [shard.name for shard in shards],
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


def is_held_out(shard_name: str, index: int, fraction: float, seed: int = 0) -> bool:
    """Whether document `index` of shard `shard_name` goes to validation.

    True when a 64-bit hash of (seed, index, shard name) is below `fraction` of its
    range: deterministic, independent per document, and independent of scheduling.
    """
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}:{shard_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# ---------------------------------------------------------------------- arrays
def _array_spec(url: str, dtype: str | None = None, size: int | None = None) -> dict[str, Any]:
    """A zarr3 spec for a 1-D array at `url`; with `dtype` and `size`, its metadata to create."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": url.rstrip("/") + "/",
        "store_data_equal_to_fill_value": True,  # token 0 is a real token: store every chunk
    }
    if dtype is None:
        return spec
    read_chunk = min(_READ_CHUNK, _next_power_of_two(max(size or 0, 1)))
    spec["metadata"] = {
        "shape": [size],
        "data_type": dtype,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [max(_SHARD_TOKENS, read_chunk)]},
        },
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [read_chunk],
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "zstd", "configuration": {"level": 1}},
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


def _create_array(directory: Directory, dtype: str, size: int) -> ts.TensorStore:
    """A new 1-D array of `size` elements, replacing any array already there."""
    spec = _array_spec(directory.url, dtype, size)
    return ts.open(spec, create=True, delete_existing=True, context=CONTEXT).result()


def _open_array(directory: Directory) -> ts.TensorStore:
    return ts.open(_array_spec(directory.url), open=True, context=CONTEXT).result()


class _PieceWriter:
    """Appends documents to one split of a piece: tokens (grown as needed), then offsets."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._tokens: ts.TensorStore | None = None
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._written = 0
        self._lengths: list[int] = []

    def append(self, document: np.ndarray) -> None:
        self._buffer.append(document)
        self._buffered += len(document)
        self._lengths.append(len(document))
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def close(self) -> dict[str, int]:
        """Writes what is buffered and the offsets; returns the split's counts."""
        self._flush()
        if self._tokens is None:
            _create_array(self._directory.child("tokens"), "int32", 0)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        _create_array(self._directory.child("offsets"), "int64", len(offsets)).write(
            offsets
        ).result()
        return {"documents": len(self._lengths), "tokens": self._written}

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = np.concatenate(self._buffer)
        end = self._written + len(data)
        if self._tokens is None:  # sized by the first write, so small pieces get small chunks
            self._tokens = _create_array(self._directory.child("tokens"), "int32", end)
        else:
            self._tokens = self._tokens.resize(exclusive_max=[end]).result()
        self._tokens[self._written : end].write(data).result()
        self._written = end
        self._buffer, self._buffered = [], 0


# ---------------------------------------------------------------------- one shard (Ray task)
@dataclass(frozen=True)
class _PieceJob:
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


@functools.lru_cache(maxsize=4)
def _tokenizer(sha256: str, text: str) -> Tokenizer:
    """The tokenizer of a tokenizer.json's text, parsed once per process."""
    return Tokenizer.from_str(text)


def _build_piece(job: _PieceJob, tokenizer_json: str) -> dict[str, Any]:
    """Tokenizes one shard into a new piece, then records it in the ledger; returns the entry."""
    _test_hook(job.shard.name)
    tokenizer = _tokenizer(job.tokenizer_sha256, tokenizer_json)
    bos = np.array([] if job.bos_id is None else [job.bos_id], dtype=np.int32)
    root = Directory(job.root_url)
    attempt = uuid.uuid4().hex[:12]  # a task left running by a killed driver writes elsewhere
    piece = root.child("pieces", str(job.position), attempt)
    writers = {split: _PieceWriter(piece.child(split)) for split in _splits(job.holdout_fraction)}
    stats = ReadStats()
    documents = read_shard(job.shard, skip_bad_records=job.skip_bad_records, stats=stats)
    index = 0
    for batch in _batched(itertools.islice(documents, job.max_documents), _ENCODE_BATCH):
        for tokens in encode_documents(tokenizer, batch):
            held_out = is_held_out(job.shard.name, index, job.holdout_fraction, job.holdout_seed)
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
    }
    root.child("ledger").write_json(f"{job.position}.json", entry)  # after the piece; atomic
    return entry


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _splits(holdout_fraction: float) -> tuple[str, ...]:
    return ("train", "validation") if holdout_fraction > 0 else ("train",)


def _test_hook(shard_name: str) -> None:
    """Fault injection for tests, active only when `_TEST_HOOK_ENV` is set."""
    folder = os.environ.get(_TEST_HOOK_ENV)
    if not folder:
        return
    sleep, fail = Path(folder, "sleep"), Path(folder, "fail-once")
    if sleep.is_file():
        time.sleep(float(sleep.read_text()))
    if fail.is_file() and fail.read_text() == shard_name:
        fail.unlink(missing_ok=True)
        raise RuntimeError(f"test hook: shard {shard_name} fails once")


# ---------------------------------------------------------------------- running the tasks
_Outcome = tuple[_PieceJob, "dict[str, Any] | BaseException"]


def _run_on_ray(jobs: Sequence[_PieceJob], tokenizer_json: str) -> Iterator[_Outcome]:
    """Runs `jobs` as Ray tasks, a few per CPU at a time, in order; yields them as they end.

    After the first failure no new task starts, but running ones finish (their work is
    kept in the ledger). Closing the iterator cancels the tasks still running.
    """
    import ray

    task = ray.remote(_build_piece)
    tokenizer_ref = ray.put(tokenizer_json)
    in_flight = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    queue, running, failed = deque(jobs), {}, False
    try:
        while running or (queue and not failed):
            while queue and not failed and len(running) < in_flight:
                job = queue.popleft()
                running[task.remote(job, tokenizer_ref)] = job
            [ref], _ = ray.wait(list(running), num_returns=1)
            job = running.pop(ref)
            try:
                outcome: dict[str, Any] | BaseException = ray.get(ref)
            except ray.exceptions.RayError as error:
                outcome, failed = getattr(error, "cause", None) or error, True
            yield job, outcome
    finally:
        for ref in running:
            ray.cancel(ref)


def _run_here(jobs: Sequence[_PieceJob], tokenizer_json: str) -> Iterator[_Outcome]:
    """Runs `jobs` one by one in this process (for stores other processes cannot see)."""
    for job in jobs:
        try:
            yield job, _build_piece(job, tokenizer_json)
        except Exception as error:  # reported by the caller, like a failed Ray task
            yield job, error
            return


# ---------------------------------------------------------------------- the build
@dataclass(frozen=True)
class _Build:
    """The fixed inputs of one build, shared by its steps."""

    root: Directory
    shards: Sequence[Shard]
    settings: dict[str, Any]
    key: str
    tokenizer_file: Path
    token_ids: dict[str, int | None]
    """`vocab_size`, `eos_id` and `bos_id` (None without `bos`), recorded in meta.json."""
    skip_bad_records: bool

    @property
    def max_documents(self) -> int | None:
        return self.settings["max_documents"]

    @property
    def holdout(self) -> dict[str, Any]:
        return self.settings["holdout"]

    def job(self, position: int) -> _PieceJob:
        return _PieceJob(
            position=position,
            shard=self.shards[position],
            root_url=self.root.url,
            fingerprint=self.key,
            tokenizer_sha256=self.settings["tokenizer_sha256"],
            bos_id=self.token_ids["bos_id"],
            max_documents=self.max_documents,
            holdout_fraction=self.holdout["fraction"],
            holdout_seed=self.holdout["seed"],
            skip_bad_records=self.skip_bad_records,
        )

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


def build_token_cache(
    shards: Sequence[Shard],
    tokenizer_path: str | os.PathLike,
    cache_url: str | os.PathLike,
    *,
    max_documents: int | None = None,
    holdout_fraction: float = 0.0,
    holdout_seed: int = 0,
    bos: bool = False,
    skip_bad_records: bool = False,
    overwrite: bool = False,
    ray_config: RayConfig = RayConfig(),
    progress: bool = True,
) -> TokenCacheInfo:
    """Tokenizes `shards` with Ray into a token cache at `cache_url`, or resumes that build.

    Documents are ordered by shard, then within it; `max_documents` keeps the first
    that many. Each becomes its tokens followed by EOS (preceded by BOS if `bos`),
    exactly as `encode_documents` makes them. A complete cache with the same settings is
    returned as is; one with other settings raises `TokenCacheError` naming what
    differs, unless `overwrite` deletes it first. `ray_config` says which Ray cluster
    to use; if Ray is already initialized it is used as is.
    `memory://` caches are built in this process, since Ray workers cannot see them.
    """
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or null, got {max_documents}")
    if not shards:
        raise ValueError("token cache: no shards to tokenize")
    tokenizer_file = resolve_tokenizer_path(tokenizer_path)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    settings = cache_settings(
        shards,
        tokenizer_file,
        max_documents=max_documents,
        holdout_fraction=holdout_fraction,
        holdout_seed=holdout_seed,
        bos=bos,
    )
    build = _Build(
        root=Directory(to_url(cache_url)),
        shards=shards,
        settings=settings,
        key=fingerprint(settings),
        tokenizer_file=tokenizer_file,
        token_ids={
            "vocab_size": tokenizer.get_vocab_size(),
            "eos_id": eos_id(tokenizer),
            "bos_id": bos_id(tokenizer) if bos else None,  # raises now if there is none
        },
        skip_bad_records=skip_bad_records,
    )
    meta, tokenized = _claim(build, overwrite), 0
    if meta is None:
        ledger = _read_ledger(build)
        before = len(ledger)
        if build.shards_used(ledger) is None:
            _tokenize_missing(build, ledger, ray_config, progress)
        tokenized = len(ledger) - before
        meta = _finish(build, ledger)
    _delete_pieces(build.root)
    return _info(build.root, meta, tokenized)


def _claim(build: _Build, overwrite: bool) -> dict | None:
    """Checks what is at the cache URL: the meta of a complete, matching cache, or None.

    Refuses a cache (complete or not) built with other settings unless `overwrite`, and
    anything that is not a token cache. Records the settings in `build.json`.
    """
    root = build.root
    found = root.read_json(META_FILE) or root.read_json(BUILD_FILE)
    if found is None:
        if not _is_empty(root):
            raise TokenCacheError(
                f"token cache: {root} is not empty and holds no token cache "
                f"(no {META_FILE} or {BUILD_FILE}); give an empty or new path"
            )
    elif found.get("fingerprint") == build.key:
        return root.read_json(META_FILE)
    elif not overwrite:
        raise TokenCacheError(
            f"token cache: {root} was built with other settings "
            f"({_difference(found.get('settings', {}), build.settings)}); give a new path "
            "(e.g. named by cache_fingerprint), or overwrite=True to delete it and rebuild"
        )
    else:
        root.delete(first=META_FILE)
    root.write_json(BUILD_FILE, {"fingerprint": build.key, "settings": build.settings})
    return None


def _is_empty(root: Directory) -> bool:
    path = local_path(root.url)
    if path is not None:
        return not os.path.isdir(path) or not os.listdir(path)
    return not root.keys()


def _difference(cached: dict, wanted: dict) -> str:
    """What differs between two settings records, briefly, e.g. `bos: cache false, now true`."""
    parts = []
    for name in sorted(set(cached) | set(wanted)):
        old, new = cached.get(name), wanted.get(name)
        if old == new:
            continue
        if isinstance(old, list) and isinstance(new, list):
            pairs = enumerate(zip(old, new, strict=False))
            index = next((i for i, (a, b) in pairs if a != b), None)
            detail = f"{len(old)} entries, now {len(new)}"
            if index is not None:
                detail += f"; first difference at [{index}]: {old[index]!r}, now {new[index]!r}"
            parts.append(f"{name}: {detail}")
        else:
            parts.append(f"{name}: cache {json.dumps(old)}, now {json.dumps(new)}")
    return "; ".join(parts)


def _read_ledger(build: _Build) -> dict[int, dict]:
    """The ledger entries of this build (same fingerprint and shard name), by position."""
    store = ts.KvStore.open(join(build.root.url, "ledger") + "/", context=CONTEXT).result()
    keys = [key.decode() for key in store.list().result()]
    reads = [(key, store.read(key)) for key in keys if key.removesuffix(".json").isdigit()]
    ledger = {}
    for key, read in reads:  # all reads are in flight at once
        result = read.result()
        position = int(key.removesuffix(".json"))
        if result.state != "value" or position >= len(build.shards):
            continue
        entry = json.loads(bytes(result.value))
        if (
            entry.get("fingerprint") == build.key
            and entry.get("name") == build.shards[position].name
        ):
            ledger[position] = entry
    return ledger


def _tokenize_missing(
    build: _Build, ledger: dict[int, dict], ray_config: RayConfig, progress: bool
) -> None:
    """Tokenizes shards the ledger lacks, in order, until the shards used are all in it.

    Runs on Ray, or in this process for memory:// caches. Raises `TokenCacheError` naming
    the first shard that failed, after the shards already running have finished.
    """
    jobs = [build.job(i) for i in range(len(build.shards)) if i not in ledger]
    tokenizer_json = build.tokenizer_file.read_text(encoding="utf-8")
    if build.root.url.startswith("memory://"):
        _collect(build, ledger, _run_here(jobs, tokenizer_json), progress)
        return
    with ray_session(ray_config):
        _collect(build, ledger, _run_on_ray(jobs, tokenizer_json), progress)


def _collect(
    build: _Build, ledger: dict[int, dict], runner: Iterator[_Outcome], progress: bool
) -> None:
    """Adds the outcomes of `runner` to `ledger`, with a progress bar; raises on failure."""
    failures: list[tuple[_PieceJob, BaseException]] = []
    tokens = sum(_entry_tokens(entry) for entry in ledger.values())
    bar = tqdm(
        total=len(build.shards),
        initial=len(ledger),
        desc="token cache",
        unit="shard",
        file=sys.stderr,
        disable=not progress,
    )
    try:
        for job, outcome in runner:
            if isinstance(outcome, BaseException):
                failures.append((job, outcome))
                continue
            ledger[job.position] = outcome
            tokens += _entry_tokens(outcome)
            bar.update()
            bar.set_postfix(tokens=f"{tokens:,}")
            if not failures and build.shards_used(ledger) is not None:
                break
    finally:
        runner.close()
        bar.close()
    if failures:
        job, error = failures[0]
        raise TokenCacheError(
            f"token cache: tokenizing shard {job.shard.name} failed "
            f"({len(failures)} shard(s) failed; finished shards are kept, rerun to resume): "
            f"{type(error).__name__}: {error}"
        ) from error


def _entry_tokens(entry: dict) -> int:
    return sum(split["tokens"] for split in entry["splits"].values())


def _delete_pieces(root: Directory) -> None:
    pieces = root.child("pieces")
    path = local_path(pieces.url)
    if path is None or os.path.isdir(path):
        pieces.delete()


# ---------------------------------------------------------------------- assembly
def _finish(build: _Build, ledger: dict[int, dict]) -> dict:
    """Copies the pieces of the shards used into the flat arrays, then writes `meta.json`."""
    used = build.shards_used(ledger)
    assert used is not None, "every shard used is in the ledger"
    entries = [ledger[position] for position in range(used)]
    kept = _kept_counts(build, entries)
    splits = {}
    for split in _splits(build.holdout["fraction"]):
        counts = [shard_counts[split] for shard_counts in kept]
        _assemble_split(build.root, split, entries, counts)
        splits[split] = {
            "documents": sum(c["documents"] for c in counts),
            "tokens": sum(c["tokens"] for c in counts),
        }
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": build.key,
        "settings": build.settings,
        "tokenizer": str(build.tokenizer_file),
        **build.token_ids,
        "splits": splits,
        "shards": {"total": len(build.shards), "used": used},
        "documents_skipped": sum(entry["skipped"] for entry in entries),
        "skipped_examples": [e for entry in entries for e in entry["skipped_examples"]][:10],
    }
    build.root.write_json(META_FILE, meta)
    return meta


def _kept_counts(build: _Build, entries: list[dict]) -> list[dict[str, dict[str, int]]]:
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


def _cut_counts(build: _Build, entry: dict, documents: int) -> dict[str, dict[str, int]]:
    """The per-split counts of the first `documents` documents of a shard."""
    fraction, seed = build.holdout["fraction"], build.holdout["seed"]
    held_out = sum(is_held_out(entry["name"], i, fraction, seed) for i in range(documents))
    counts = {}
    for split, split_documents in (("train", documents - held_out), ("validation", held_out)):
        if split in entry["splits"]:
            offsets = _open_array(_piece(build.root, entry, split).child("offsets"))
            tokens = int(offsets[split_documents].read().result())
            counts[split] = {"documents": split_documents, "tokens": tokens}
    return counts


def _piece(root: Directory, entry: dict, split: str) -> Directory:
    return root.child("pieces", str(entry["position"]), entry["piece"], split)


def _assemble_split(root: Directory, split: str, entries: list[dict], counts: list[dict]) -> None:
    """Writes `<split>/tokens` and `<split>/offsets` from the pieces, each at its global offset."""
    num_documents = sum(c["documents"] for c in counts)
    tokens = _create_array(root.child(split, "tokens"), "int32", sum(c["tokens"] for c in counts))
    offsets = _create_array(root.child(split, "offsets"), "int64", num_documents + 1)
    offsets[0].write(0).result()
    pending: deque[ts.WriteFutures] = deque()
    doc_base = token_base = 0
    for entry, count in zip(entries, counts, strict=True):
        n_docs, n_tokens = count["documents"], count["tokens"]
        if n_docs == 0:
            continue
        piece = _piece(root, entry, split)
        source = _open_array(piece.child("tokens"))[:n_tokens]
        pending.append(tokens[token_base : token_base + n_tokens].write(source))
        piece_offsets = _open_array(piece.child("offsets"))[1 : n_docs + 1].read().result()
        pending.append(
            offsets[doc_base + 1 : doc_base + n_docs + 1].write(piece_offsets + token_base)
        )
        while len(pending) > 2 * _COPY_WINDOW:
            pending.popleft().result()
        doc_base += n_docs
        token_base += n_tokens
    for write in pending:
        write.result()


def _info(root: Directory, meta: dict, tokenized: int) -> TokenCacheInfo:
    return TokenCacheInfo(
        url=root.url,
        fingerprint=meta["fingerprint"],
        splits={name: SplitInfo(**counts) for name, counts in meta["splits"].items()},
        documents_skipped=meta["documents_skipped"],
        shards_total=meta["shards"]["total"],
        shards_used=meta["shards"]["used"],
        shards_tokenized=tokenized,
    )


# ---------------------------------------------------------------------- reading
class TokenSplit:
    """One split of a finished cache: a flat token array and its document offsets."""

    def __init__(self, directory: Directory, documents: int, tokens: int) -> None:
        self._tokens = _open_array(directory.child("tokens"))
        self._offsets = _open_array(directory.child("offsets"))
        self.num_documents = documents
        self.num_tokens = tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start:stop` of the split as a new int32 array."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range {start}:{stop} out of range for {self.num_tokens}")
        return self._tokens[start:stop].read().result()

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (with its EOS, and BOS if the cache has them)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.num_documents}")
        start, stop = self._offsets[index : index + 2].read().result()
        return self.read(int(start), int(stop))

    def offsets(self) -> np.ndarray:
        """All document offsets, int64 of length `num_documents + 1`."""
        return self._offsets.read().result()

    def as_numpy(self) -> np.ndarray:
        """The whole split in memory (for small caches)."""
        return self.read(0, self.num_tokens)


class TokenCache:
    """A finished token cache, opened for reading: `cache.splits["train"].read(0, 2048)`."""

    def __init__(self, url: str, meta: dict) -> None:
        self.url = url
        self.meta = meta
        root = Directory(url)
        self.splits = {
            name: TokenSplit(root.child(name), counts["documents"], counts["tokens"])
            for name, counts in meta["splits"].items()
        }

    @classmethod
    def open(cls, cache_url: str | os.PathLike) -> TokenCache:
        """Opens the cache at `cache_url`; `TokenCacheError` if it is missing or incomplete."""
        root = Directory(to_url(cache_url))
        meta = root.read_json(META_FILE)
        if meta is None:
            raise TokenCacheError(
                f"token cache: {display(root.url)} has no {META_FILE}: it is missing or its "
                "build did not finish; run the build (again) to complete it"
            )
        if meta.get("format") != FORMAT_VERSION:
            raise TokenCacheError(
                f"token cache: {display(root.url)} has format {meta.get('format')}, "
                f"this version reads {FORMAT_VERSION}; rebuild it"
            )
        return cls(root.url, meta)

    def __getitem__(self, split: str) -> TokenSplit:
        if split not in self.splits:
            raise KeyError(
                f"token cache {display(self.url)} has no split {split!r}: {list(self.splits)}"
            )
        return self.splits[split]
