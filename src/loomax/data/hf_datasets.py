"""Hugging Face datasets as sources: the `hf` config, its shards' sizes, and reading them.

A non-streaming split is read in row ranges; a streaming one in pieces of its
`IterableDataset`. `datasets` is imported only when a dataset is loaded. A row whose text
is missing or not a string is a bad record, rejected like those of files (`readers`).
With `text_template` a document is several columns formatted together
(`"{question}\n{answer}"`); a row missing one of them, or null there, is rejected.
"""

import json
import math
import os
import string
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from loomax.data.readers import Reject, describe_error
from loomax.errors import DataSourceError, MissingPackageError

HF_ROWS_PER_SHARD = 100_000
"""Rows per shard of a non-streaming Hugging Face dataset when `num_shards` is null."""

_BATCH_ROWS = 1024
"""Rows decoded at a time from a dataset slice."""


@dataclass(frozen=True)
class HfSourceConfig:
    """A Hugging Face dataset split: a Hub id, a local dataset directory or a packaged builder."""

    id: str
    """Hub id (`org/name`), a local directory (from `save_to_disk`, or of data files), or a builder like `json`."""

    name: str | None = None
    """Dataset configuration (subset), e.g. `sample-10BT`; null = the default one."""

    split: str = "train"
    """Split to read."""

    text_key: str = "text"
    """Column holding the document text."""

    streaming: bool = False
    """Stream the data files instead of downloading and preparing the whole split first."""

    revision: str | None = None
    """Hub branch, tag or commit to read; pin it so the token cache key follows the data."""

    data_dir: str | None = None
    """Subdirectory of the dataset repository to read (passed to `load_dataset`)."""

    data_files: list[str] = field(default_factory=list)
    """Data files or globs to read (passed to `load_dataset`); empty = the dataset's own."""

    num_shards: int | None = None
    """Shards to read in parallel: row ranges, or when streaming groups of data files; null = one per 100k rows, or per data file."""

    text_template: str | None = None
    """A document made of several columns, as a Python format string (e.g. "Q: {question} A: {answer}"); null = the text_key column."""

    def __post_init__(self) -> None:
        for key in ("id", "split", "text_key"):
            if not getattr(self, key):
                raise ValueError(f"data source: `hf.{key}` must not be empty")
        if self.text_template is not None:
            template_columns(self.text_template)  # a bad template fails here
        if isinstance(self.data_files, str):
            raise ValueError("data source: `hf.data_files` must be a list of paths or globs")
        if self.num_shards is not None and self.num_shards < 1:
            raise ValueError(
                f"data source: `hf.num_shards` must be >= 1 or null, got {self.num_shards}"
            )


def template_columns(template: str) -> list[str]:
    """The columns ``template`` formats (``{name}`` fields, in order, once each); a
    ``ValueError`` naming ``hf.text_template`` for a malformed one or one with no column."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"data source: `hf.text_template` {template!r}: {e}") from None
    bad = [f for f in fields if not f.isidentifier()]
    if bad or not fields:
        problem = f"fields must be column names, got {bad}" if bad else "it names no {column}"
        raise ValueError(f"data source: `hf.text_template` {template!r}: {problem}")
    return list(dict.fromkeys(fields))


def text_columns(hf: HfSourceConfig) -> list[str]:
    """The columns a document is made of: the template's, or ``text_key``."""
    return template_columns(hf.text_template) if hf.text_template else [hf.text_key]


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
    columns = text_columns(hf)
    problem = next(
        (p for c in columns if (p := _feature_problem(dataset.features, c, hf)) is not None), None
    )
    if problem is not None:
        if stop > start:
            reject(f"{label}, rows {start}-{stop - 1}", problem, stop - start)
        return
    rows = dataset.select_columns(columns).with_format(None)
    for begin in range(start, stop, _BATCH_ROWS):
        end = min(stop, begin + _BATCH_ROWS)
        batch = rows[begin:end]
        for i in range(end - begin):
            record = {c: batch[c][i] for c in columns}
            yield from _document(record, hf, f"{label}, row {begin + i}", reject)


def read_hf_stream(hf: HfSourceConfig, index: int, count: int, reject: Reject) -> Iterator[str]:
    """The texts of piece `index` of `count` of a streaming dataset."""
    dataset = load_hf(hf)
    if count > 1:
        dataset = dataset.shard(num_shards=count, index=index)
    columns = text_columns(hf)
    features = dataset.features
    if features is not None and all(c in features for c in columns):
        dataset = dataset.select_columns(columns)
    where = f"{hf_label(hf)}:stream[{index}/{count}]"
    for row, record in enumerate(dataset):
        yield from _document(record, hf, f"{where}, row {row}", reject)


def _document(record: dict, hf: HfSourceConfig, where: str, reject: Reject) -> Iterator[str]:
    """The row's document (its text column, or the template filled), or a rejection."""
    if hf.text_template is None:
        if hf.text_key not in record:
            reject(where, f"no column {hf.text_key!r} (set `hf.text_key`)")
        else:
            yield from _checked_text(record[hf.text_key], where, hf.text_key, reject)
        return
    for column in text_columns(hf):
        if record.get(column) is None:
            state = "null" if column in record else "missing"
            reject(where, f"column {column!r} of `hf.text_template` is {state}")
            return
    yield hf.text_template.format(**record)


def _checked_text(value: object, where: str, text_key: str, reject: Reject) -> Iterator[str]:
    """`value` if it is a string; otherwise rejects it."""
    if isinstance(value, str):
        yield value
    else:
        kind = "null" if value is None else f"a {type(value).__name__}, not a string"
        reject(where, f"{text_key!r} is {kind}")


def _feature_problem(features: Any, text_key: str, hf: HfSourceConfig) -> str | None:
    """Why dataset `features` have no column `text_key` (a string one, unless a template
    formats it), or None if they have."""
    key = "hf.text_template" if hf.text_template else "hf.text_key"
    if text_key not in features:
        return f"no column {text_key!r} (columns: {', '.join(features)}; set `{key}`)"
    dtype = getattr(features[text_key], "dtype", None)
    if hf.text_template is None and dtype not in ("string", "large_string"):
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
        raise DataSourceError(
            f"data source {hf_label(hf)}: cannot load{offline}: {describe_error(error)}"
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
        raise DataSourceError(
            f"data source {label}: `hf.{unused[0]}` is not used for a dataset saved with "
            "save_to_disk; leave it unset"
        )
    dataset = datasets.load_from_disk(path)
    split = hf.split
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataSourceError(
                f"data source {label}: no split {split!r} in {path}; splits: {', '.join(dataset)}"
            )
        dataset = dataset[split]
    elif dataset.split is not None and str(dataset.split) != split:
        raise DataSourceError(f"data source {label}: {path} holds split {dataset.split!r}")
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
