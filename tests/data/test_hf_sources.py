"""Hugging Face dataset sources: saved datasets, parquet directories and packaged builders in
row-range or streaming shards, their errors, and the lazy `datasets` import."""

import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomax.data.sources import (
    HfSourceConfig,
    ReadStats,
    SourceConfig,
    iter_documents,
    read_shard,
    source_shards,
)


def hf_source(**kwargs) -> SourceConfig:
    return SourceConfig(hf=HfSourceConfig(**kwargs))


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps what `datasets.load_dataset` prepares out of the user's HF cache. (`datasets` is
    imported here, not at collection, where it would cost every xdist worker ~3 s.)"""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def saved_dataset(tmp_path: Path) -> Path:
    """A `save_to_disk` DatasetDict: train has 10 rows, validation 3."""
    import datasets

    train = datasets.Dataset.from_dict(
        {"text": [f"doc {i}" for i in range(10)], "id": list(range(10))}
    )
    validation = datasets.Dataset.from_dict({"text": ["v0", "v1", "v2"], "id": [0, 1, 2]})
    path = tmp_path / "saved"
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(str(path))
    return path


@pytest.fixture
def parquet_dataset(tmp_path: Path) -> Path:
    """A directory of three parquet files of four rows each, loadable by `load_dataset`."""
    root = tmp_path / "pq_dataset"
    (root / "data").mkdir(parents=True)
    for k in range(3):
        texts = [f"f{k} r{j}" for j in range(4)]
        pq.write_table(pa.table({"text": texts}), root / "data" / f"train-{k}.parquet")
    return root


def test_hf_saved_dataset_in_row_range_shards(saved_dataset: Path) -> None:
    source = hf_source(id=str(saved_dataset), num_shards=3)
    shards = source_shards(source)
    label = f"hf:{saved_dataset}:train"
    assert [(s.name, s.rows, s.count, s.paths) for s in shards] == [
        (f"{label}:rows[0:3]", (0, 3), 3, ()),
        (f"{label}:rows[3:6]", (3, 6), 3, ()),
        (f"{label}:rows[6:10]", (6, 10), 3, ()),
    ]
    restored = pickle.loads(pickle.dumps(shards[2]))
    assert list(read_shard(restored)) == ["doc 6", "doc 7", "doc 8", "doc 9"]
    assert list(iter_documents(source)) == [f"doc {i}" for i in range(10)]
    validation = hf_source(id=str(saved_dataset), split="validation", num_shards=8)
    assert [s.rows for s in source_shards(validation)] == [(0, 1), (1, 2), (2, 3)]
    assert list(iter_documents(validation)) == ["v0", "v1", "v2"]


def test_hf_saved_dataset_streaming(saved_dataset: Path) -> None:
    source = hf_source(id=str(saved_dataset), streaming=True, num_shards=2)
    shards = source_shards(source)
    assert [(s.name, s.rows, s.count) for s in shards] == [
        (f"hf:{saved_dataset}:train:stream[0/2]", None, 2),
        (f"hf:{saved_dataset}:train:stream[1/2]", None, 2),
    ]
    parts = [list(read_shard(pickle.loads(pickle.dumps(shard)))) for shard in shards]
    assert parts == [[f"doc {i}" for i in range(5)], [f"doc {i}" for i in range(5, 10)]]


def test_hf_parquet_directory(parquet_dataset: Path) -> None:
    everything = [f"f{k} r{j}" for k in range(3) for j in range(4)]
    source = hf_source(id=str(parquet_dataset))
    assert [s.rows for s in source_shards(source)] == [(0, 12)]
    assert list(iter_documents(source)) == everything
    streaming = hf_source(id=str(parquet_dataset), streaming=True)
    shards = source_shards(streaming)
    assert [s.count for s in shards] == [3, 3, 3]
    assert [list(read_shard(s)) for s in shards] == [everything[i : i + 4] for i in (0, 4, 8)]
    grouped = source_shards(hf_source(id=str(parquet_dataset), streaming=True, num_shards=2))
    assert [len(list(read_shard(s))) for s in grouped] == [8, 4]


def test_hf_packaged_builder_with_data_files(parquet_dataset: Path) -> None:
    files = [str(parquet_dataset / "data" / f"train-{k}.parquet") for k in (2, 0)]
    source = hf_source(id="parquet", data_files=files)
    assert list(iter_documents(source)) == [f"f{k} r{j}" for k in (2, 0) for j in range(4)]


def test_hf_errors_name_the_dataset(saved_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no split 'test' in .*saved; splits: train, validation"):
        source_shards(hf_source(id=str(saved_dataset), split="test"))
    with pytest.raises(ValueError, match=r"`hf.name` is not used for a dataset saved"):
        source_shards(hf_source(id=str(saved_dataset), name="sample"))
    source = hf_source(id=str(saved_dataset), text_key="body")
    (shard,) = source_shards(source)
    with pytest.raises(ValueError, match=r"rows 0-9: no column 'body' \(columns: text, id"):
        list(read_shard(shard))
    stats = ReadStats()
    assert list(read_shard(shard, skip_bad_records=True, stats=stats)) == []
    assert stats.skipped == 10
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"hf:{empty}:train: cannot load"):
        source_shards(hf_source(id=str(empty)))


def test_hf_null_texts_are_bad_records(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "nulls"
    datasets.Dataset.from_dict({"text": ["a", None, "c"]}).save_to_disk(str(path))
    for streaming in (False, True):
        (shard,) = source_shards(hf_source(id=str(path), streaming=streaming))
        with pytest.raises(ValueError, match=r", row 1: 'text' is null"):
            list(read_shard(shard))
        stats = ReadStats()
        assert list(read_shard(shard, skip_bad_records=True, stats=stats)) == ["a", "c"]
        assert (stats.documents, stats.skipped) == (2, 1)


def test_hf_text_template_joins_several_columns(tmp_path: Path) -> None:
    import datasets

    from loomax.data.sources import source_fingerprint

    path = tmp_path / "qa"
    rows = {"question": ["2+2?", "Sky?", "Up?"], "answer": [4, 7, None], "id": [0, 1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    template = "Q: {question}\nA: {answer}"
    for streaming in (False, True):
        source = hf_source(id=str(path), text_template=template, streaming=streaming)
        (shard,) = source_shards(source)
        with pytest.raises(
            ValueError, match=r", row 2: column 'answer' of `hf.text_template` is null"
        ):
            list(read_shard(shard))
        stats = ReadStats()
        got = list(read_shard(shard, skip_bad_records=True, stats=stats))
        assert got == ["Q: 2+2?\nA: 4", "Q: Sky?\nA: 7"] and stats.skipped == 1
    (shard,) = source_shards(hf_source(id=str(path), text_template="{question} {body}"))
    with pytest.raises(ValueError, match=r"no column 'body' .*set `hf.text_template`"):
        list(read_shard(shard))
    for bad, problem in (
        ("{question", "expected '}'"),
        ("plain", "names no"),
        ("{0}", "column names"),
    ):
        with pytest.raises(ValueError, match=rf"`hf.text_template` .*{problem}"):
            HfSourceConfig(id=str(path), text_template=bad)
    # the template is part of the cache key
    plain, templated = hf_source(id=str(path)), hf_source(id=str(path), text_template=template)
    assert source_fingerprint(plain) != source_fingerprint(templated)


def test_datasets_is_imported_only_for_hf_sources() -> None:
    code = (
        "import sys, loomax.data.sources, loomax.data.readers;"
        "assert 'datasets' not in sys.modules, 'datasets imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
