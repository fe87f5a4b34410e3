"""Format readers: the documents of one file, or of one slice of a Hugging Face dataset.

Files are opened through fsspec, so a local path and any URL it knows (`gs://`, `s3://`,
`memory://`, ...) read alike. A `.txt` file is one document; a `.jsonl` line is one
document, the string under `text_key`; a `.parquet` row is one document, its `text_key`
column, read one row group at a time. `.gz` and `.zst` compression is undone on the fly.

A bad record (invalid JSON, a missing or non-string text, bytes that are not UTF-8)
raises ValueError naming the file and line (row, from 0, for parquet and datasets), or,
with `skip_bad_records`, is skipped and counted in a `ReadStats`.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

import fsspec

from loomax.errors import DataSourceError, MissingPackageError

if TYPE_CHECKING:
    from loomax.data.sources import HfSourceConfig

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

HF_ROWS_PER_SHARD = 100_000
"""Rows per shard of a non-streaming Hugging Face dataset when `num_shards` is null."""

_PARQUET_BATCH_ROWS = 1024
"""Rows decoded at a time from a parquet row group or a dataset slice."""


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


def rejecter(skip_bad_records: bool, stats: ReadStats) -> Reject:
    """A `Reject` that raises, or with `skip_bad_records` counts the records in `stats`."""

    def reject(where: str, why: str, count: int = 1) -> None:
        if not skip_bad_records:
            raise DataSourceError(f"data source: {where}: {why}")
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
        raise ValueError(
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
    """The whole file as one document."""
    with fsspec.open(url, "rb") as raw:
        try:
            data = _open_bytes(raw, compression).read()
        except Exception as error:
            raise ValueError(f"data source: {url}: cannot read ({_describe(error)})") from error
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as error:
        reject(url, f"not valid UTF-8 (byte {error.start})")


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
                f"data source: {url}: cannot read after line {number} ({_describe(error)})"
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
            raise ValueError(
                f"data source: {url}: not a readable parquet file ({_describe(error)})"
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
                raise ValueError(
                    f"data source: {url}, row {row}: cannot read ({_describe(error)})"
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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- Hugging Face


def hf_label(hf: HfSourceConfig) -> str:
    """`hf:<id>[@revision][:<name>]:<split>`: names the dataset in shard names and errors."""
    revision = f"@{hf.revision}" if hf.revision else ""
    name = f":{hf.name}" if hf.name else ""
    return f"hf:{hf.id}{revision}{name}:{hf.split}"


def hf_num_rows(hf: HfSourceConfig) -> int:
    """Rows of a non-streaming dataset split (downloading and preparing it if needed)."""
    return len(load_hf(hf))


def hf_num_streams(hf: HfSourceConfig) -> int:
    """How many independent pieces (`IterableDataset.num_shards`) a streaming dataset has."""
    dataset = load_hf(hf)
    return getattr(dataset, "num_shards", None) or dataset.n_shards


def hf_default_shards(rows: int) -> int:
    """Shards of a non-streaming dataset of `rows` rows when `num_shards` is null."""
    return max(1, math.ceil(rows / HF_ROWS_PER_SHARD))


def read_hf_rows(hf: HfSourceConfig, start: int, stop: int, reject: Reject) -> Iterator[str]:
    """The texts of rows `[start, stop)` of a non-streaming dataset."""
    dataset = load_hf(hf)
    label = hf_label(hf)
    problem = _feature_problem(dataset.features, hf.text_key)
    if problem is not None:
        if stop > start:
            reject(f"{label}, rows {start}-{stop - 1}", problem, stop - start)
        return
    texts = dataset.select_columns([hf.text_key]).with_format(None)
    for begin in range(start, stop, _PARQUET_BATCH_ROWS):
        end = min(stop, begin + _PARQUET_BATCH_ROWS)
        for row, value in enumerate(texts[begin:end][hf.text_key], start=begin):
            yield from _checked_text(value, f"{label}, row {row}", hf.text_key, reject)


def read_hf_stream(hf: HfSourceConfig, index: int, count: int, reject: Reject) -> Iterator[str]:
    """The texts of piece `index` of `count` of a streaming dataset."""
    dataset = load_hf(hf)
    if count > 1:
        dataset = dataset.shard(num_shards=count, index=index)
    features = dataset.features
    if features is not None and hf.text_key in features:
        dataset = dataset.select_columns([hf.text_key])
    where = f"{hf_label(hf)}:stream[{index}/{count}]"
    for row, record in enumerate(dataset):
        if hf.text_key not in record:
            reject(f"{where}, row {row}", f"no column {hf.text_key!r} (set `hf.text_key`)")
            continue
        yield from _checked_text(record[hf.text_key], f"{where}, row {row}", hf.text_key, reject)


def _checked_text(value: object, where: str, text_key: str, reject: Reject) -> Iterator[str]:
    """`value` if it is a string; otherwise rejects it."""
    if isinstance(value, str):
        yield value
    else:
        kind = "null" if value is None else f"a {type(value).__name__}, not a string"
        reject(where, f"{text_key!r} is {kind}")


def _feature_problem(features: Any, text_key: str) -> str | None:
    """Why dataset `features` have no string column `text_key`, or None if they have."""
    if text_key not in features:
        return f"no column {text_key!r} (columns: {', '.join(features)}; set `hf.text_key`)"
    dtype = getattr(features[text_key], "dtype", None)
    if dtype not in ("string", "large_string"):
        return f"column {text_key!r} holds {features[text_key]}, not strings"
    return None


def load_hf(hf: HfSourceConfig) -> Any:
    """The dataset split `hf` names: a `Dataset`, or an `IterableDataset` when streaming.

    `id` is a directory written by `save_to_disk`, any other local directory or packaged
    builder (`json`, `parquet`, ...) `datasets.load_dataset` reads, or a Hub id (from the
    HF cache when `HF_DATASETS_OFFLINE=1`). Loaded once per process and config.
    """
    key = json.dumps(asdict(hf), sort_keys=True)
    if key not in _loaded:
        if len(_loaded) >= 8:
            _loaded.pop(next(iter(_loaded)))
        _loaded[key] = _load_hf(hf)
    return _loaded[key]


_loaded: dict[str, Any] = {}
"""Datasets this process has loaded, by config (oldest first)."""


def _load_hf(hf: HfSourceConfig) -> Any:
    datasets = _import_datasets()
    path = os.path.expanduser(hf.id)
    if _is_saved_dataset(path):
        return _load_saved(datasets, path, hf)
    try:
        return datasets.load_dataset(
            path if os.path.isdir(path) else hf.id,
            name=hf.name,
            split=hf.split,
            streaming=hf.streaming,
            revision=hf.revision,
            data_dir=hf.data_dir,
            data_files=list(hf.data_files) or None,
        )
    except Exception as error:
        offline = (
            " (offline: only the HF cache is used)"
            if getattr(datasets.config, "HF_HUB_OFFLINE", False)
            else ""
        )
        raise ValueError(
            f"data source {hf_label(hf)}: cannot load{offline}: {_describe(error)}"
        ) from error


def _is_saved_dataset(path: str) -> bool:
    """Whether `path` is a directory written by `Dataset(Dict).save_to_disk`."""
    return any(
        os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json")
    )


def _load_saved(datasets: Any, path: str, hf: HfSourceConfig) -> Any:
    """The split of a `save_to_disk` directory, as an `IterableDataset` when streaming."""
    label = hf_label(hf)
    unused = [key for key in ("name", "revision", "data_dir", "data_files") if getattr(hf, key)]
    if unused:
        raise ValueError(
            f"data source {label}: `hf.{unused[0]}` is not used for a dataset saved with "
            "save_to_disk; leave it unset"
        )
    dataset = datasets.load_from_disk(path)
    split = hf.split
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(
                f"data source {label}: no split {split!r} in {path}; splits: {', '.join(dataset)}"
            )
        dataset = dataset[split]
    elif dataset.split is not None and str(dataset.split) != split:
        raise ValueError(f"data source {label}: {path} holds split {dataset.split!r}")
    if not hf.streaming:
        return dataset
    shards = hf.num_shards or hf_default_shards(len(dataset))
    return dataset.to_iterable_dataset(num_shards=max(1, min(shards, len(dataset))))


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise MissingPackageError(
            "data source: `hf` sources need the `datasets` package (pip install datasets)"
        ) from error
    return datasets
