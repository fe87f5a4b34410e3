"""Format readers: the documents of one file (Hugging Face datasets: `hf_datasets`).

Files are opened through fsspec, so a local path and any URL it knows (`gs://`, `s3://`,
`memory://`, ...) read alike. A `.txt` file is one document (none if it is empty or
only whitespace, as a blank `.jsonl` line is none); a `.jsonl` line is one document, the
string under `text_key`; a `.parquet` row is one document, its `text_key` column, read
one row group at a time. `.gz` and `.zst` compression is undone on the fly.

A bad record (invalid JSON, a missing or non-string text, bytes that are not UTF-8)
raises ValueError naming the file and line (row, from 0, for parquet and datasets), or,
with `skip_bad_records`, is skipped and counted in a `ReadStats`.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from loomax.errors import DataSourceError

SUPPORTED_EXTENSIONS = (
    ".txt",
    ".txt.gz",
    ".txt.zst",
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    ".parquet",
)
"""File name endings `read_file` can read."""

_PARQUET_BATCH_ROWS = 1024
"""Rows decoded at a time from a parquet row group."""


@dataclass
class ReadStats:
    """What reading a shard found: documents yielded, bad records skipped (and a few examples)."""

    documents: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)

    def skip(self, where: str, why: str, count: int = 1) -> None:
        """Counts `count` skipped records; keeps the first few reasons as examples."""
        self.skipped += count
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


Reject = Callable[..., None]
"""`reject(where, why, count=1)`: raise DataSourceError for a bad record, or count it as skipped."""


BAD_RECORD_FIX = "fix the record, or set `data.skip_bad_records: true` to skip bad ones"
"""What a bad-record error says to do."""

DAMAGED_FILE_FIX = "the file is damaged or not what its name says: replace it or leave it out"
"""What an unreadable-file error says to do."""


def rejecter(skip_bad_records: bool, stats: ReadStats) -> Reject:
    """A `Reject` that raises, or with `skip_bad_records` counts the records in `stats`."""

    def reject(where: str, why: str, count: int = 1) -> None:
        if not skip_bad_records:
            raise DataSourceError(f"data source: {where}: {why}; {BAD_RECORD_FIX}")
        stats.skip(where, why, count)

    return reject


def file_format(path: str) -> tuple[str, str | None] | None:
    """`(format, compression)` of a file by its name, e.g. `("jsonl", "zst")`; None if unsupported."""
    for extension in SUPPORTED_EXTENSIONS:
        if path.endswith(extension):
            kind, _, compression = extension[1:].partition(".")
            return kind, compression or None
    return None


def read_file(
    url: str,
    text_key: str = "text",
    *,
    skip_bad_records: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """Yields the documents of one file (local path or fsspec URL), in order."""
    found = file_format(url)
    if found is None:
        raise DataSourceError(
            f"data source: cannot read {url}: unsupported file type; "
            f"supported extensions: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    kind, compression = found
    stats = stats if stats is not None else ReadStats()
    reject = rejecter(skip_bad_records, stats)
    if kind == "parquet":
        documents = _read_parquet(url, text_key, reject)
    else:
        documents = (_read_txt if kind == "txt" else _read_jsonl)(
            url, compression, text_key, reject
        )
    for document in documents:
        stats.documents += 1
        yield document


def _open_bytes(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A buffered, decompressing reader over `raw`."""
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw)
    if compression == "zst":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader)  # type: ignore[arg-type]
    return raw


def _read_txt(url: str, compression: str | None, text_key: str, reject: Reject) -> Iterator[str]:
    """The whole file as one document; none if it is empty or only whitespace."""
    with fsspec.open(url, "rb") as raw:
        try:
            data = _open_bytes(raw, compression).read()
        except Exception as error:
            raise DataSourceError(
                f"data source: {url}: cannot read ({describe_error(error)}); {DAMAGED_FILE_FIX}"
            ) from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        reject(url, f"not valid UTF-8 (byte {error.start})")
        return
    if text.strip():  # like a blank .jsonl line: nothing to learn from, not a document
        yield text


def _read_jsonl(url: str, compression: str | None, text_key: str, reject: Reject) -> Iterator[str]:
    """`record[text_key]` of each non-blank line."""
    with fsspec.open(url, "rb") as raw:
        for number, line in _numbered_lines(_open_bytes(raw, compression), url):
            if not line.strip():
                continue
            where = f"{url}, line {number}"
            try:
                text = line.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                reject(where, f"not valid UTF-8 (byte {error.start} of the line)")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                reject(where, f"invalid JSON ({error})")
                continue
            if not isinstance(record, dict):
                reject(where, f"a JSON {type(record).__name__}, not an object")
                continue
            if text_key not in record:
                reject(where, f"no key {text_key!r} (set `text_key`)")
                continue
            value = record[text_key]
            if not isinstance(value, str):
                reject(where, f"{text_key!r} is a {type(value).__name__}, not a string")
                continue
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                reject(where, f"{text_key!r} has an unpaired surrogate at {error.start}")
                continue
            yield value


def _numbered_lines(file: IO[bytes], url: str) -> Iterator[tuple[int, bytes]]:
    """`(line number from 1, line)` pairs; a read or decompression error names the file."""
    number = 0
    while True:
        try:
            line = file.readline()
        except Exception as error:
            raise DataSourceError(
                f"data source: {url}: cannot read after line {number} ({describe_error(error)}); "
                f"{DAMAGED_FILE_FIX}"
            ) from error
        if not line:
            return
        number += 1
        yield number, line


def _read_parquet(url: str, text_key: str, reject: Reject) -> Iterator[str]:
    """The `text_key` column of each row, streamed one row group (batch) at a time."""
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb") as raw:
        try:
            parquet = pq.ParquetFile(raw)
        except Exception as error:
            raise DataSourceError(
                f"data source: {url}: not a readable parquet file ({describe_error(error)}); "
                f"{DAMAGED_FILE_FIX}"
            ) from error
        rows = parquet.metadata.num_rows
        problem = _column_problem(parquet.schema_arrow, text_key)
        if problem is not None:
            if rows:
                reject(url, problem, rows)
            return
        row = 0
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key])
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as error:
                raise DataSourceError(
                    f"data source: {url}, row {row}: cannot read ({describe_error(error)}); "
                    f"{DAMAGED_FILE_FIX}"
                ) from error
            for value in batch.column(0).to_pylist():
                if value is None:
                    reject(f"{url}, row {row}", f"{text_key!r} is null")
                else:
                    yield value
                row += 1


def _column_problem(schema: Any, text_key: str) -> str | None:
    """Why an arrow schema has no usable string column `text_key`, or None if it has."""
    import pyarrow as pa

    if schema.get_field_index(text_key) < 0:
        return f"no column {text_key!r} (columns: {', '.join(schema.names)}; set `text_key`)"
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f"column {text_key!r} holds {kind}, not strings"
    return None


def describe_error(error: BaseException) -> str:
    """`Type: message` of an exception, for error messages."""
    return f"{type(error).__name__}: {error}"
