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
