"""Sources: listing files and URLs, shards, fingerprints, presets (Hugging Face datasets: test_hf_sources)."""

import gzip
import json
import os
import pickle
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomax.config import parse_config
from loomax.data import DataConfig
from loomax.data.sources import (
    HfSourceConfig,
    ReadStats,
    SourceConfig,
    check_source_files,
    iter_documents,
    read_shard,
    source_fingerprint,
    source_paths,
    source_shards,
)
from loomax.errors import MissingFileError


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def hf_source(**kwargs) -> SourceConfig:
    return SourceConfig(hf=HfSourceConfig(**kwargs))


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps what `datasets.load_dataset` prepares out of the user's HF cache. (`datasets` is
    imported here, not at collection, where it would cost every xdist worker ~3 s.)"""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


# --------------------------------------------------------------------------- files


def test_txt_files_are_one_document_each(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\nstill second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    documents = list(iter_documents(SourceConfig(urls=[str(tmp_path / "*.txt")])))
    assert documents == ["first", "second\nstill second"]


def test_every_format_in_one_source(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text file", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"body": "plain"}])
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"body": "gzip"}\n'))
    pq.write_table(pa.table({"body": ["parquet 0", "parquet 1"]}), tmp_path / "d.parquet")
    source = SourceConfig(urls=[f"file://{tmp_path}/*"], text_key="body")
    assert [shard.name for shard in source_shards(source)] == [
        str(tmp_path / name) for name in ("a.txt", "b.jsonl", "c.jsonl.gz", "d.parquet")
    ]
    documents = ["text file", "plain", "gzip", "parquet 0", "parquet 1"]
    assert list(iter_documents(source)) == documents


def test_brace_expansion_keeps_pattern_order(tmp_path: Path) -> None:
    for i in range(12):
        write_jsonl(tmp_path / f"shard_{i}.jsonl", [{"text": f"doc {i}"}])
    source = SourceConfig(
        urls=[str(tmp_path / "shard_{9..11}.jsonl"), str(tmp_path / "shard_{0,2}.jsonl")]
    )
    assert list(iter_documents(source)) == ["doc 9", "doc 10", "doc 11", "doc 0", "doc 2"]


def test_globs_are_sorted_deduplicated_and_skip_hidden_files_and_folders(tmp_path: Path) -> None:
    for name in ["c", "a", "b", ".hidden"]:
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    (tmp_path / "folder.txt").mkdir()
    source = SourceConfig(urls=[str(tmp_path / "*.txt"), str(tmp_path / "a.txt")])
    assert [p.name for p in source_paths(source)] == ["a.txt", "b.txt", "c.txt"]
    assert list(iter_documents(source)) == ["a", "b", "c"]


def test_recursive_globs_and_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "top.txt").write_text("top", encoding="utf-8")
    (tmp_path / "x" / "y" / "deep.txt").write_text("deep", encoding="utf-8")
    source = SourceConfig(urls=["~/x/**/*.txt"])
    assert source_paths(source) == [tmp_path / "x" / "top.txt", tmp_path / "x" / "y" / "deep.txt"]
    assert list(iter_documents(source)) == ["top", "deep"]  # sorted by full path


def test_memory_urls_with_globs_and_braces() -> None:
    for i in range(4):
        with fsspec.open(f"memory://sources/part_{i}.jsonl.gz", "wb") as f:
            f.write(gzip.compress(json.dumps({"text": f"m{i}"}).encode() + b"\n"))
    source = SourceConfig(urls=["memory://sources/part_{3,1}.jsonl.gz", "memory://sources/*.gz"])
    shards = source_shards(source)
    assert [shard.name for shard in shards] == [
        f"memory:///sources/part_{i}.jsonl.gz" for i in (3, 1, 0, 2)
    ]
    assert [shard.paths for shard in shards] == [(shard.name,) for shard in shards]
    assert list(iter_documents(source)) == ["m3", "m1", "m0", "m2"]
    with pytest.raises(ValueError, match="not a local file"):
        source_paths(source)


def test_shards_are_files_in_order_and_picklable(tmp_path: Path) -> None:
    for i in range(3):
        write_jsonl(tmp_path / f"s{i}.jsonl", [{"text": f"{i}.{j}"} for j in range(2)])
    shards = source_shards(SourceConfig(urls=[str(tmp_path / "s*.jsonl")]))
    assert [(s.index, s.count, s.paths) for s in shards] == [
        (i, 3, (str(tmp_path / f"s{i}.jsonl"),)) for i in range(3)
    ]
    restored = pickle.loads(pickle.dumps(shards[1]))
    assert restored == shards[1]
    stats = ReadStats()
    assert list(read_shard(restored, stats=stats)) == ["1.0", "1.1"]
    assert stats.documents == 2


def test_read_shard_skips_and_counts_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n{"other": 1}\n{"text": "end"}\n', encoding="utf-8")
    (shard,) = source_shards(SourceConfig(urls=[str(path)]))
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: invalid JSON"):
        list(read_shard(shard))
    stats = ReadStats()
    assert list(read_shard(shard, skip_bad_records=True, stats=stats)) == ["ok", "end"]
    assert (stats.documents, stats.skipped) == (2, 2)
    assert stats.examples[1] == f"{path}, line 3: no key 'text' (set `text_key`)"


def test_max_documents_caps_after_sorting(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(3)])
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(2)])
    source = SourceConfig(urls=[str(tmp_path / "*.jsonl")], max_documents=3)
    assert list(iter_documents(source)) == ["a0", "a1", "b0"]  # a.jsonl first, cut inside b
    whole = SourceConfig(urls=[str(tmp_path / "*.jsonl")], max_documents=100)
    assert list(iter_documents(whole)) == ["a0", "a1", "b0", "b1", "b2"]


def test_missing_text_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"text": "fine"}, {"content": "no text here"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: no key 'text'"):
        list(iter_documents(SourceConfig(urls=[str(path)])))


def test_pattern_matching_nothing_is_named(tmp_path: Path) -> None:
    (tmp_path / "shard_0.txt").write_text("x", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"shard_1\.txt \(from .*shard_\{0\.\.1\}"):
        iter_documents(SourceConfig(urls=[str(tmp_path / "shard_{0..1}.txt")]))
    with pytest.raises(FileNotFoundError, match=r"memory://nowhere/\*\.jsonl"):
        source_shards(SourceConfig(urls=["memory://nowhere/*.jsonl"]))


def test_unknown_extension_names_file_and_supported(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"notes\.md: unsupported.*\.txt, .*\.jsonl\.zst"):
        iter_documents(SourceConfig(urls=[str(tmp_path / "notes.md")]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"urls": ["a.txt"], "embedded": "python_stdlib"},
            "exactly one of .*`urls` and `embedded`",
        ),
        ({"urls": ["a.txt"], "hf": HfSourceConfig("x")}, "got `urls` and `hf`"),
        ({}, "give exactly one of `urls`"),
        ({"embedded": "wikipedia"}, "unknown `embedded` corpus 'wikipedia'"),
        ({"urls": "a.txt"}, "`urls` must be a list"),
        ({"urls": ["nosuchfs://bucket/a.txt"]}, "unknown protocol 'nosuchfs'"),
        ({"urls": ["a.txt"], "weight": 0.0}, "`weight` must be > 0"),
        ({"urls": ["a.txt"], "max_documents": 0}, "`max_documents` must be >= 1"),
        ({"hf": HfSourceConfig("x"), "text_key": "body"}, "set `hf.text_key`"),
    ],
)
def test_invalid_source_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SourceConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id": ""}, "`hf.id` must not be empty"),
        ({"id": "x", "split": ""}, "`hf.split` must not be empty"),
        ({"id": "x", "num_shards": 0}, "`hf.num_shards` must be >= 1"),
        ({"id": "x", "data_files": "a.parquet"}, "`hf.data_files` must be a list"),
    ],
)
def test_invalid_hf_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HfSourceConfig(**kwargs)


def test_remote_urls_are_accepted() -> None:
    urls = ["gs://bucket/shard_{0..127}.jsonl.gz", "s3://b/*.parquet"]
    source = SourceConfig(urls=list(urls))  # nothing is listed or fetched when configuring
    assert source.urls == urls and source.text_key == "text" and source.weight == 1.0


def test_python_stdlib_corpus() -> None:
    source = SourceConfig(embedded="python_stdlib", max_documents=20)
    paths = source_paths(source)
    assert len(paths) > 200
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [p.relative_to(root).as_posix() for p in paths]
    assert relative == sorted(relative)
    assert "os.py" in relative and "json/decoder.py" in relative
    excluded = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(excluded.intersection(p.split("/")) for p in relative)
    documents = list(iter_documents(source))
    expected = [p.read_text(encoding="utf-8", errors="replace") for p in paths[:20]]
    assert documents == expected and sum(len(d) for d in documents) > 1000
    shards = source_shards(source)
    assert sum(len(s.paths) for s in shards) == len(paths)
    assert shards[0].name == "python_stdlib[0]" and shards[0].count == len(shards)


# --------------------------------------------------------------------------- fingerprints


def test_fingerprint_is_stable_and_tracks_files_and_config(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("hello", encoding="utf-8")
    source = SourceConfig(urls=[str(path)])
    first = source_fingerprint(source)
    assert source_fingerprint(SourceConfig(urls=[str(path)])) == first
    assert source_fingerprint(SourceConfig(urls=[str(path)], max_documents=1)) != first
    path.write_text("hello, longer", encoding="utf-8")
    assert source_fingerprint(source) != first
    changed = source_fingerprint(source)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert source_fingerprint(source) != changed


def test_fingerprint_of_memory_files_follows_rewrites() -> None:
    with fsspec.open("memory://fp/a.jsonl", "wb") as f:
        f.write(b'{"text": "one"}\n')
    source = SourceConfig(urls=["memory://fp/*.jsonl"])
    first = source_fingerprint(source)
    assert source_fingerprint(source) == first
    with fsspec.open("memory://fp/a.jsonl", "wb") as f:
        f.write(b'{"text": "two"}\n')
    assert source_fingerprint(source) != first


def test_fingerprint_of_a_local_hf_dataset_follows_its_files(tmp_path: Path) -> None:
    data = tmp_path / "pq"
    data.mkdir()
    pq.write_table(pa.table({"text": ["a"]}), data / "train.parquet")
    source = hf_source(id=str(data))
    first = source_fingerprint(source)
    assert source_fingerprint(source) == first
    assert source_fingerprint(hf_source(id=str(data), split="test")) != first
    pq.write_table(pa.table({"text": ["a", "b"]}), data / "train.parquet")
    assert source_fingerprint(source) != first
    hub = source_fingerprint(hf_source(id="org/name"))
    assert hub != source_fingerprint(hf_source(id="org/name", revision="v2"))


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class _Run:
    data: DataConfig


@pytest.mark.parametrize(
    ("preset", "hf"),
    [
        (
            "fineweb_edu",
            HfSourceConfig("HuggingFaceFW/fineweb-edu", name="sample-10BT", streaming=True),
        ),
        ("openwebtext", HfSourceConfig("Skylion007/openwebtext", num_shards=64)),
    ],
)
def test_presets_parse_as_the_data_section(
    repo_root: Path, tmp_path: Path, preset: str, hf: HfSourceConfig
) -> None:
    path = repo_root / "config" / "data" / f"{preset}.yaml"
    config = parse_config(DataConfig, path)
    assert config.train == [SourceConfig(hf=hf)]
    run = tmp_path / "run.yaml"
    run.write_text(f"data: !include {path}\n", encoding="utf-8")
    assert parse_config(_Run, run).data == config


def test_a_pattern_that_matches_nothing_is_named_by_its_config_key(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    found, missing = SourceConfig(urls=["a.txt"]), SourceConfig(urls=["{a,b}.txt"])
    check_source_files([found], [found])  # every pattern matches: nothing raised
    with pytest.raises(MissingFileError) as error:
        check_source_files([found], [found, missing])
    assert str(error.value).startswith(
        f"data.validation[1].urls: no files match b.txt (from {{a,b}}.txt), relative to the "
        f"current directory {tmp_path}; give paths, globs or URLs"
    )
