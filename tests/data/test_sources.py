"""Reading documents from files and from the embedded corpus."""

import json
import os
import sysconfig
from pathlib import Path

import pytest

from loomax.data.sources import SourceConfig, iter_documents, source_fingerprint, source_paths


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def test_txt_files_are_one_document_each(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\nstill second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    documents = list(iter_documents(SourceConfig(urls=[str(tmp_path / "*.txt")])))
    assert documents == ["first", "second\nstill second"]


def test_jsonl_lines_are_documents_under_text_key(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"body": "one", "id": 1}) + "\n\n" + json.dumps({"body": "two"}) + "\n",
        encoding="utf-8",
    )
    source = SourceConfig(urls=[str(path)], text_key="body")
    assert list(iter_documents(source)) == ["one", "two"]


def test_brace_expansion_keeps_pattern_order(tmp_path: Path) -> None:
    for i in range(12):
        write_jsonl(tmp_path / f"shard_{i}.jsonl", [{"text": f"doc {i}"}])
    source = SourceConfig(
        urls=[str(tmp_path / "shard_{9..11}.jsonl"), str(tmp_path / "shard_{0,2}.jsonl")]
    )
    assert list(iter_documents(source)) == ["doc 9", "doc 10", "doc 11", "doc 0", "doc 2"]


def test_globs_are_sorted_and_deduplicated(tmp_path: Path) -> None:
    for name in ["c", "a", "b"]:
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    source = SourceConfig(urls=[str(tmp_path / "*.txt"), str(tmp_path / "a.txt")])
    assert [p.name for p in source_paths(source)] == ["a.txt", "b.txt", "c.txt"]
    assert list(iter_documents(source)) == ["a", "b", "c"]


def test_max_documents_caps_after_sorting(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "x.jsonl", [{"text": str(i)} for i in range(5)])
    source = SourceConfig(urls=[str(tmp_path / "x.jsonl")], max_documents=2)
    assert list(iter_documents(source)) == ["0", "1"]


def test_missing_text_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"text": "fine"}, {"content": "no text here"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: no key 'text'"):
        list(iter_documents(SourceConfig(urls=[str(path)])))


def test_pattern_matching_nothing_is_named(tmp_path: Path) -> None:
    (tmp_path / "shard_0.txt").write_text("x", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"shard_1\.txt"):
        iter_documents(SourceConfig(urls=[str(tmp_path / "shard_{0..1}.txt")]))


def test_unknown_extension_names_file_and_supported(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"notes\.md.*\.txt, \.jsonl"):
        iter_documents(SourceConfig(urls=[str(tmp_path / "notes.md")]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": ["a.txt"], "embedded": "python_stdlib"}, "either `urls` or `embedded`, not both"),
        ({}, "either `urls`"),
        ({"embedded": "wikipedia"}, "unknown `embedded` corpus 'wikipedia'"),
        ({"urls": "a.txt"}, "`urls` must be a list"),
        ({"urls": ["gs://bucket/a.txt"]}, "only local files"),
        ({"urls": ["a.txt"], "weight": 0.0}, "`weight` must be > 0"),
        ({"urls": ["a.txt"], "max_documents": 0}, "`max_documents` must be >= 1"),
    ],
)
def test_invalid_source_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SourceConfig(**kwargs)


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
    assert len(documents) == 20
    assert sum(len(d) for d in documents) > 1000


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
