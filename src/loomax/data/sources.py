"""Data sources: which files hold the documents, and how to read them.

A source is either a list of local files (paths, globs and brace expansion) or an
embedded corpus. `.txt` files hold one document each; `.jsonl` files hold one document
per line, as the string under `text_key` of a JSON object.
"""

import dataclasses
import glob
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loomax.data.braces import expand_braces
from loomax.data.embedded import EMBEDDED_CORPORA, embedded_paths

SUPPORTED_EXTENSIONS = (".txt", ".jsonl")
"""File name endings `iter_documents` can read."""


@dataclass(frozen=True)
class SourceConfig:
    """One source of documents: local files (`urls`) or an embedded corpus (`embedded`)."""

    urls: list[str] = field(default_factory=list)
    """Local paths or globs of .txt/.jsonl files; brace expansion like shard_{0..3}.jsonl allowed."""

    text_key: str = "text"
    """Key of the document text in each .jsonl record."""

    weight: float = 1.0
    """Mixture weight, > 0. Recorded only for now: sources are concatenated."""

    embedded: str | None = None
    """Name of an embedded corpus instead of `urls`; `python_stdlib` is the Python standard library's sources."""

    max_documents: int | None = None
    """Use only the first this many documents (in sorted order); null means all."""

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):
            raise ValueError(
                f"data source: `urls` must be a list of paths, got the string {self.urls!r}"
            )
        if self.urls and self.embedded is not None:
            raise ValueError("data source: give either `urls` or `embedded`, not both")
        if not self.urls and self.embedded is None:
            raise ValueError(
                "data source: give either `urls` (local files) or `embedded` "
                f"(one of: {', '.join(EMBEDDED_CORPORA)})"
            )
        if self.embedded is not None and self.embedded not in EMBEDDED_CORPORA:
            raise ValueError(
                f"data source: unknown `embedded` corpus {self.embedded!r}; "
                f"known: {', '.join(EMBEDDED_CORPORA)}"
            )
        for url in self.urls:
            if "://" in url:
                raise ValueError(
                    f"data source: `urls` entry {url!r} is not a local path; "
                    "only local files are supported for now"
                )
        if not self.text_key:
            raise ValueError("data source: `text_key` must not be empty")
        if not self.weight > 0:
            raise ValueError(f"data source: `weight` must be > 0, got {self.weight}")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(
                f"data source: `max_documents` must be >= 1 or null, got {self.max_documents}"
            )


def source_paths(source: SourceConfig) -> list[Path]:
    """The files of `source`, in order: patterns as listed, each glob's matches sorted.

    Raises FileNotFoundError naming a pattern that matches no file, and ValueError naming
    a file whose extension is not in `SUPPORTED_EXTENSIONS`.
    """
    if source.embedded is not None:
        return embedded_paths(source.embedded)
    paths: dict[str, None] = {}
    for url in source.urls:
        for pattern in expand_braces(os.path.expanduser(url)):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                named = pattern if pattern == url else f"{pattern} (from {url})"
                raise FileNotFoundError(f"data source: no files match {named}")
            paths.update(dict.fromkeys(matches))
    for path in paths:
        if not path.endswith(SUPPORTED_EXTENSIONS):
            raise ValueError(
                f"data source: cannot read {path}: unsupported file type; "
                f"supported extensions: {', '.join(SUPPORTED_EXTENSIONS)}"
            )
    return [Path(path) for path in paths]


EMBEDDED_SHARD_FILES = 64
"""Files of an embedded corpus per shard (one document per file)."""


@dataclass(frozen=True)
class Shard:
    """A piece of a source that one worker reads on its own: a file, or a group of files."""

    source: SourceConfig
    index: int
    """Position among the source's shards; documents are ordered by shard, then within it."""
    name: str
    """Stable, unique name (the file path or URL, or a description), used in ledgers and errors."""
    paths: tuple[str, ...]
    """The files this shard reads, in order."""


@dataclass
class ReadStats:
    """What reading a shard found: documents yielded, bad records skipped (and a few examples)."""

    documents: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


def source_shards(source: SourceConfig) -> list[Shard]:
    """The shards of `source` in document order: one per file (embedded corpora: groups of files)."""
    paths = [str(p) for p in source_paths(source)]
    if source.embedded is not None:
        groups = [
            paths[i : i + EMBEDDED_SHARD_FILES] for i in range(0, len(paths), EMBEDDED_SHARD_FILES)
        ]
        return [
            Shard(source, i, f"{source.embedded}[{i}]", tuple(group))
            for i, group in enumerate(groups)
        ]
    return [Shard(source, i, path, (path,)) for i, path in enumerate(paths)]


def read_shard(
    shard: Shard, *, skip_bad_records: bool = False, stats: ReadStats | None = None
) -> Iterator[str]:
    """Yields the documents of `shard` in order.

    A bad record (invalid JSON, missing `text_key`, undecodable bytes) raises ValueError
    naming the file and line, or with `skip_bad_records` is skipped and counted in `stats`.
    `max_documents` is not applied here (it counts across shards).
    """
    stats = stats if stats is not None else ReadStats()
    for document in _iter_all_documents(shard.source, [Path(p) for p in shard.paths]):
        stats.documents += 1
        yield document


def iter_documents(source: SourceConfig) -> Iterator[str]:
    """Yields the documents of `source` in a deterministic order, at most `max_documents`."""
    documents = _iter_all_documents(source, source_paths(source))
    return itertools.islice(documents, source.max_documents)


def source_fingerprint(source: SourceConfig) -> str:
    """A hex digest that changes when the config or any of its files (path, size, mtime) does.

    Used as a cache key: equal fingerprints mean the documents can be assumed unchanged.
    """
    files = []
    for path in source_paths(source):
        stat = path.stat()
        files.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])
    record = {"config": dataclasses.asdict(source), "files": files}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _iter_all_documents(source: SourceConfig, paths: list[Path]) -> Iterator[str]:
    """Yields every document of every file in `paths`."""
    for path in paths:
        if source.embedded is not None:
            yield path.read_text(encoding="utf-8", errors="replace")
        elif path.suffix == ".txt":
            yield _read_utf8(path)
        else:
            yield from _iter_jsonl(path, source.text_key)


def _read_utf8(path: Path) -> str:
    """The text of a UTF-8 file; ValueError naming the file if it is not valid UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"data source: {path} is not valid UTF-8 ({error})") from error


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    """Yields `record[text_key]` for each non-blank line of a .jsonl file."""
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"data source: {where}: invalid JSON ({error})") from error
            if not isinstance(record, dict) or text_key not in record:
                raise ValueError(f"data source: {where}: no key {text_key!r} (set `text_key`)")
            text = record[text_key]
            if not isinstance(text, str):
                raise ValueError(
                    f"data source: {where}: {text_key!r} is a {type(text).__name__}, not a string"
                )
            yield text
