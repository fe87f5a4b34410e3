"""Data sources: where the documents are, cut into shards that workers read on their own.

A source is exactly one of: files (`urls`: local paths or fsspec URLs, with globs and
brace expansion; see `readers` for the formats), an embedded corpus (`embedded`), or a
Hugging Face dataset (`hf`). A file is one shard; a dataset is cut into row ranges (or,
streaming, into groups of its data files).
"""

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from loomax.data import hf_datasets, readers
from loomax.data.braces import expand_braces
from loomax.data.embedded import EMBEDDED_CORPORA, embedded_paths
from loomax.data.hf_datasets import HfSourceConfig
from loomax.data.readers import SUPPORTED_EXTENSIONS, ReadStats
from loomax.errors import DataSourceError, MissingFileError

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "HfSourceConfig",
    "ReadStats",
    "Shard",
    "SourceConfig",
    "iter_documents",
    "read_shard",
    "source_file_sizes",
    "source_fingerprint",
    "source_paths",
    "source_shards",
]


@dataclass(frozen=True)
class SourceConfig:
    """One source of documents: files (`urls`), an embedded corpus, or a Hugging Face dataset (`hf`)."""

    urls: list[str] = field(default_factory=list)
    """Local paths or fsspec URLs (gs://, s3://, ...) of .txt, .jsonl(.gz/.zst) or .parquet files; globs and braces like shard_{0..3}.jsonl allowed."""

    text_key: str = "text"
    """Key of the document text in each .jsonl record, or column of a .parquet file."""

    weight: float = 1.0
    """Mixture weight among the `data.train` sources, > 0."""

    embedded: str | None = None
    """Name of an embedded corpus instead of `urls`; `python_stdlib` is the Python standard library's sources."""

    hf: HfSourceConfig | None = None
    """A Hugging Face dataset instead of `urls`, e.g. {id: HuggingFaceFW/fineweb-edu, name: sample-10BT}."""

    max_documents: int | None = None
    """Use only the first this many documents (in shard order); null means all."""

    records_per_shard: int | None = None
    """Read the source as one stream cut into shards of this many records as it is read (a source too large to list up front); null = one shard per file or dataset piece."""

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):
            raise ValueError(
                f"data source: `urls` must be a list of paths, got the string {self.urls!r}"
            )
        given = [
            key
            for key, value in (("urls", self.urls), ("embedded", self.embedded), ("hf", self.hf))
            if value
        ]
        if len(given) != 1:
            got = f"; got {' and '.join(f'`{key}`' for key in given)}" if given else ""
            raise ValueError(
                "data source: give exactly one of `urls` (files or URLs), `embedded` "
                f"(one of: {', '.join(EMBEDDED_CORPORA)}) or `hf` (a Hugging Face dataset){got}"
            )
        if self.embedded is not None and self.embedded not in EMBEDDED_CORPORA:
            raise ValueError(
                f"data source: unknown `embedded` corpus {self.embedded!r}; "
                f"known: {', '.join(EMBEDDED_CORPORA)}"
            )
        for url in self.urls:
            protocol = url.split("://", 1)[0] if "://" in url else None
            if protocol is not None and protocol not in fsspec.available_protocols():
                raise ValueError(
                    f"data source: `urls` entry {url!r} has an unknown protocol {protocol!r}"
                )
        if not self.text_key:
            raise ValueError("data source: `text_key` must not be empty")
        if self.hf is not None and self.text_key != "text":
            raise ValueError("data source: for an `hf` source set `hf.text_key`, not `text_key`")
        if not self.weight > 0:
            raise ValueError(f"data source: `weight` must be > 0, got {self.weight}")
        if self.records_per_shard is not None and self.records_per_shard < 1:
            raise ValueError(
                "data source: `records_per_shard` must be >= 1 or null, "
                f"got {self.records_per_shard}"
            )
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(
                f"data source: `max_documents` must be >= 1 or null, got {self.max_documents}"
            )


EMBEDDED_SHARD_FILES = 64
"""Files of an embedded corpus per shard (one document per file)."""


@dataclass(frozen=True)
class Shard:
    """A piece of a source that one worker reads on its own: a file, a group of files, or rows."""

    source: SourceConfig
    """The source this shard belongs to."""

    index: int
    """Position among the source's shards; documents are ordered by shard, then within it."""

    name: str
    """Stable, unique name (the file path or URL, or a description), used in ledgers and errors."""

    paths: tuple[str, ...]
    """The files this shard reads, in order (local paths or URLs); empty for an `hf` shard."""

    rows: tuple[int, int] | None = None
    """Non-streaming `hf` source: the rows [start, stop) of the split this shard reads."""

    count: int = 1
    """How many shards the source has (a streaming `hf` shard is piece `index` of `count`)."""


def source_shards(source: SourceConfig) -> list[Shard]:
    """The shards of `source` in document order.

    One per file; an embedded corpus in groups of `EMBEDDED_SHARD_FILES` files; an `hf`
    source in `num_shards` contiguous row ranges, or when streaming in pieces of the
    `IterableDataset` (at most one per data file). Listing a non-streaming Hub dataset
    downloads and prepares it into the HF cache.
    """
    if source.hf is not None:
        return _hf_shards(source, source.hf)
    paths = [url for url, _ in _list_files(source)]
    if source.embedded is not None:
        groups = [
            paths[i : i + EMBEDDED_SHARD_FILES] for i in range(0, len(paths), EMBEDDED_SHARD_FILES)
        ]
        return [
            Shard(source, i, f"{source.embedded}[{i}]", tuple(group), count=len(groups))
            for i, group in enumerate(groups)
        ]
    return [Shard(source, i, path, (path,), count=len(paths)) for i, path in enumerate(paths)]


def read_shard(
    shard: Shard, *, skip_bad_records: bool = False, stats: ReadStats | None = None
) -> Iterator[str]:
    """Yields the documents of `shard` in order; needs only the shard (e.g. in a Ray worker).

    A bad record (invalid JSON, missing or non-string text, undecodable bytes) raises
    ValueError naming the file and line (or row), or with `skip_bad_records` is skipped
    and counted in `stats`. `max_documents` is not applied here (it counts across shards).
    """
    stats = stats if stats is not None else ReadStats()
    source = shard.source
    if source.embedded is not None:
        for path in shard.paths:
            stats.documents += 1
            yield Path(path).read_text(encoding="utf-8", errors="replace")
    elif source.hf is not None:
        reject = readers.rejecter(skip_bad_records, stats)
        if shard.rows is not None:
            documents = hf_datasets.read_hf_rows(source.hf, *shard.rows, reject)
        else:
            documents = hf_datasets.read_hf_stream(source.hf, shard.index, shard.count, reject)
        for document in documents:
            stats.documents += 1
            yield document
    else:
        for path in shard.paths:
            yield from readers.read_file(
                path, source.text_key, skip_bad_records=skip_bad_records, stats=stats
            )


def iter_documents(
    source: SourceConfig, *, skip_bad_records: bool = False, stats: ReadStats | None = None
) -> Iterator[str]:
    """Yields the documents of `source` in shard order, at most `max_documents`.

    Bad records raise, or with `skip_bad_records` are skipped and counted in `stats`
    (as `read_shard` does).
    """
    shards = source_shards(source)
    documents = itertools.chain.from_iterable(
        read_shard(shard, skip_bad_records=skip_bad_records, stats=stats) for shard in shards
    )
    return itertools.islice(documents, source.max_documents)


def source_paths(source: SourceConfig) -> list[Path]:
    """The local files of a `urls` or `embedded` source, in shard order.

    Raises FileNotFoundError naming a pattern that matches no file, and ValueError for an
    unsupported file type, a URL that is not local, or an `hf` source (use `source_shards`).
    """
    if source.hf is not None:
        raise ValueError("data source: an `hf` source has no files; use `source_shards`")
    paths = [url for url, _ in _list_files(source)]
    for path in paths:
        if "://" in path:
            raise ValueError(f"data source: {path} is not a local file; use `source_shards`")
    return [Path(path) for path in paths]


def source_file_sizes(source: SourceConfig) -> list[tuple[str, int]] | None:
    """`(url, bytes)` of each file a source lists (a compressed file's own size), or None
    when its files are not listed (a Hub dataset, a `records_per_shard` stream)."""
    if source.records_per_shard is not None:
        return None
    if source.hf is not None:
        files = _hf_local_files(source.hf)
    elif source.embedded is not None:
        return [(str(path), path.stat().st_size) for path in embedded_paths(source.embedded)]
    else:
        files = _list_files(source)
    return [(url, int(info.get("size") or 0)) for url, info in files] or None


def source_fingerprint(source: SourceConfig) -> str:
    """A hex digest that changes when the config or any of its files does.

    Files are compared by URL, size and modification time or etag (as fsspec reports
    them); a local `hf` dataset by the files under its directory. A Hub dataset is keyed
    by its config only, so pin `hf.revision` to follow upstream changes.
    """
    if source.hf is not None:
        files = _hf_local_files(source.hf)
    elif source.embedded is not None:
        files = [
            (str(path), {"size": stat.st_size, "mtime": stat.st_mtime_ns})
            for path, stat in ((p, p.stat()) for p in embedded_paths(source.embedded))
        ]
    else:
        files = _list_files(source)
    config = dataclasses.asdict(source)
    if config.get("hf") and config["hf"].get("text_template") is None:
        del config["hf"]["text_template"]  # keys of caches made before the field stay valid
    record = {"config": config, "files": [[url, _version(info)] for url, info in files]}
    digest = json.dumps(record, sort_keys=True, default=str).encode()
    return hashlib.sha256(digest).hexdigest()


_VERSION_KEYS = (
    "size",
    "mtime",
    "etag",
    "ETag",
    "LastModified",
    "last_modified",
    "updated",
    "generation",
    "md5Hash",
    "crc32c",
    "version_id",
    "VersionId",
)
"""fsspec info keys that change when a file's contents do (local, gcsfs, s3fs, ...)."""


def _version(info: dict[str, Any]) -> dict[str, Any]:
    """The parts of an fsspec info record that identify a file's version."""
    version = {key: info[key] for key in _VERSION_KEYS if info.get(key) is not None}
    if set(version) <= {"size"} and "created" in info:  # e.g. memory://: no mtime, no etag
        version["created"] = info["created"]
    return version


CHECKED_REMOTE_PATTERNS = 16
"""Remote patterns (after brace expansion) a source may have for ``check_source_files`` to
list them all at start; a source with more is listed only when it is read."""


def check_source_files(train: list[SourceConfig], validation: list[SourceConfig]) -> None:
    """Fail, naming the config key (``data.train[0].urls``), when a ``urls`` pattern of a
    source matches no file: before a tokenizer is trained or a cache built. Local patterns
    are all checked; remote ones when the source has few (``CHECKED_REMOTE_PATTERNS``)."""
    for kind, sources in (("train", train), ("validation", validation)):
        for index, source in enumerate(sources):
            for url in source.urls or ():
                patterns = expand_braces(url if "://" in url else os.path.expanduser(url))
                if "://" in url and len(patterns) > CHECKED_REMOTE_PATTERNS:
                    continue
                for pattern in patterns:
                    if _glob_files(pattern):
                        continue
                    named = pattern if pattern == url else f"{pattern} (from {url})"
                    relative = "://" not in pattern and not os.path.isabs(pattern)
                    where = f", relative to the current directory {os.getcwd()}" if relative else ""
                    raise MissingFileError(
                        f"data.{kind}[{index}].urls: no files match {named}{where}; give "
                        "paths, globs or URLs of .txt/.jsonl/.parquet (optionally .gz/.zst) files"
                    )


def _list_files(source: SourceConfig) -> list[tuple[str, dict[str, Any]]]:
    """`(url, fsspec info)` of each file of a `urls` or `embedded` source, in order:
    patterns as listed, each glob's matches sorted, duplicates dropped."""
    if source.embedded is not None:
        return [(str(path), {}) for path in embedded_paths(source.embedded)]
    files: dict[str, dict[str, Any]] = {}
    for url in source.urls:
        for pattern in expand_braces(url if "://" in url else os.path.expanduser(url)):
            matches = _glob_files(pattern)
            if not matches:
                named = pattern if pattern == url else f"{pattern} (from {url})"
                raise MissingFileError(f"data source: no files match {named}")
            for match, info in matches:
                files.setdefault(match, info)
    for path in files:
        if readers.file_format(path) is None:
            raise DataSourceError(
                f"data source: cannot read {path}: unsupported file type; "
                f"supported extensions: {', '.join(SUPPORTED_EXTENSIONS)}"
            )
    return list(files.items())


def _glob_files(pattern: str) -> list[tuple[str, dict[str, Any]]]:
    """The files (not directories) matching one glob, sorted; hidden files only if asked for."""
    filesystem, path = fsspec.core.url_to_fs(pattern)
    found = filesystem.glob(path, detail=True)
    has_magic = any(char in path for char in "*?[")
    show_hidden = os.path.basename(path).startswith(".")
    matches = []
    for name, info in sorted(found.items()):
        if info.get("type") != "file":
            continue
        if has_magic and not show_hidden and os.path.basename(name).startswith("."):
            continue
        local = isinstance(filesystem, LocalFileSystem)
        matches.append((name if local else filesystem.unstrip_protocol(name), info))
    return matches


def _hf_shards(source: SourceConfig, hf: HfSourceConfig) -> list[Shard]:
    """Row ranges of a non-streaming dataset, or pieces of a streaming one."""
    label = hf_datasets.hf_label(hf)
    if hf.streaming:
        streams = hf_datasets.hf_num_streams(hf)
        count = min(hf.num_shards or streams, streams)
        return [
            Shard(source, i, f"{label}:stream[{i}/{count}]", (), count=count) for i in range(count)
        ]
    rows = hf_datasets.hf_num_rows(hf)
    count = max(1, min(hf.num_shards or hf_datasets.hf_default_shards(rows), rows))
    bounds = [i * rows // count for i in range(count + 1)]
    return [
        Shard(source, i, f"{label}:rows[{start}:{stop}]", (), (start, stop), count)
        for i, (start, stop) in enumerate(itertools.pairwise(bounds))
    ]


def _hf_local_files(hf: HfSourceConfig) -> list[tuple[str, dict[str, Any]]]:
    """Files of a local `hf` dataset (its directory, or local `data_files`) with their info."""
    filesystem = LocalFileSystem()
    root = os.path.expanduser(hf.id)
    if os.path.isdir(root):
        found = filesystem.find(root, detail=True)
    else:
        found = {}
        for pattern in hf.data_files:
            if "://" not in pattern:
                found.update(filesystem.glob(os.path.expanduser(pattern), detail=True))
    return sorted((name, info) for name, info in found.items() if info.get("type") == "file")
