"""Format readers: every file format, compressed or not, local or fsspec, and bad records."""

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
import zstandard

from loomax.data.readers import ReadStats, file_format, read_file

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "": lambda data: data,
    ".gz": gzip.compress,
    ".zst": lambda data: zstandard.ZstdCompressor().compress(data),
}


@pytest.fixture(scope="module")
def pq():
    """pyarrow.parquet, imported by the tests that write parquet: it imports pandas (~3 s),
    which at collection every xdist worker would pay."""
    import pyarrow.parquet

    return pyarrow.parquet


def jsonl_bytes(records: list[object]) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
def test_jsonl_lines_under_text_key(tmp_path: Path, compression: str) -> None:
    data = jsonl_bytes([{"body": "one", "id": 1}, {"body": "twö\nlines"}]) + b"\n  \n"
    data += jsonl_bytes([{"body": "three"}])
    path = tmp_path / f"data.jsonl{compression}"
    path.write_bytes(COMPRESSORS[compression](data))
    stats = ReadStats()
    assert list(read_file(str(path), "body", stats=stats)) == ["one", "twö\nlines", "three"]
    assert (stats.documents, stats.skipped) == (3, 0)


@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
def test_txt_file_is_one_document(tmp_path: Path, compression: str) -> None:
    path = tmp_path / f"doc.txt{compression}"
    path.write_bytes(COMPRESSORS[compression]("héllo\nworld\n".encode()))
    assert list(read_file(str(path))) == ["héllo\nworld\n"]


def test_zstd_with_several_frames(tmp_path: Path) -> None:
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(
        compressor.compress(jsonl_bytes([{"text": "a"}]))
        + compressor.compress(jsonl_bytes([{"text": "b"}]))
    )
    assert list(read_file(str(path))) == ["a", "b"]


def test_parquet_streams_row_groups_of_the_text_column(tmp_path: Path, pq) -> None:
    texts = [f"doc {i}" for i in range(2500)]
    table = pa.table({"id": list(range(2500)), "content": pa.array(texts, pa.large_string())})
    path = tmp_path / "part.parquet"
    pq.write_table(table, path, row_group_size=700)
    assert pq.ParquetFile(path).num_row_groups == 4
    stats = ReadStats()
    assert list(read_file(str(path), "content", stats=stats)) == texts
    assert stats.documents == 2500


def test_memory_urls(tmp_path: Path, pq) -> None:
    with fsspec.open("memory://readers/a.jsonl.gz", "wb") as f:
        f.write(gzip.compress(jsonl_bytes([{"text": "from memory"}])))
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["row 0", "row 1"]}), buffer)
    with fsspec.open("memory://readers/b.parquet", "wb") as f:
        f.write(buffer.getvalue().to_pybytes())
    assert list(read_file("memory://readers/a.jsonl.gz")) == ["from memory"]
    assert list(read_file("memory://readers/b.parquet")) == ["row 0", "row 1"]


def test_file_format_by_name() -> None:
    assert file_format("gs://b/shard_0.jsonl.zst") == ("jsonl", "zst")
    assert file_format("a.txt.gz") == ("txt", "gz")
    assert file_format("x.parquet") == ("parquet", None)
    assert file_format("notes.md") is None
    assert file_format("data.json") is None


def test_unknown_extension_names_file_and_supported() -> None:
    with pytest.raises(ValueError, match=r"notes\.md: unsupported file type.*\.txt, .*\.parquet"):
        list(read_file("notes.md"))


BAD_LINES = [
    (b'{"text": "fine"}\n', None),
    (b'{"text": "broken\n', "invalid JSON"),
    (b'{"content": "no text"}\n', "no key 'text' \\(set `text_key`\\)"),
    (b'{"text": 7}\n', "'text' is a int, not a string"),
    (b'["text"]\n', "a JSON list, not an object"),
    (b'{"text": "caf\xe9"}\n', "not valid UTF-8 \\(byte 13 of the line\\)"),
    (b'{"text": "\\ud800"}\n', "'text' has an unpaired surrogate"),
]


@pytest.mark.parametrize("bad", range(1, len(BAD_LINES)))
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, bad: int) -> None:
    line, why = BAD_LINES[bad]
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "ok"}\n\n' + line))
    with pytest.raises(ValueError, match=rf"bad\.jsonl\.gz, line 3: {why}"):
        list(read_file(str(path)))


def test_skip_bad_records_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(line for line, _ in BAD_LINES) + b'{"text": "last"}\n')
    stats = ReadStats()
    assert list(read_file(str(path), skip_bad_records=True, stats=stats)) == ["fine", "last"]
    assert (stats.documents, stats.skipped) == (2, len(BAD_LINES) - 1)
    assert len(stats.examples) == 5
    assert stats.examples[0].startswith(f"{path}, line 2: invalid JSON")


def test_undecodable_txt(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"ok\n\xff")
    with pytest.raises(ValueError, match=r"latin1\.txt: not valid UTF-8 \(byte 3\)"):
        list(read_file(str(path)))
    stats = ReadStats()
    assert list(read_file(str(path), skip_bad_records=True, stats=stats)) == []
    assert stats.skipped == 1


def test_parquet_null_text_names_row(tmp_path: Path, pq) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), path)
    with pytest.raises(ValueError, match=r"nulls\.parquet, row 2: 'text' is null"):
        list(read_file(str(path)))
    stats = ReadStats()
    assert list(read_file(str(path), skip_bad_records=True, stats=stats)) == ["a", "b", "d"]
    assert (stats.documents, stats.skipped) == (3, 1)


@pytest.mark.parametrize(
    ("columns", "why"),  # the tables are made in the test: pa.table imports pandas
    [
        ({"body": ["a", "b"]}, r"no column 'text' \(columns: body; set `text_key`\)"),
        ({"text": [1, 2]}, "column 'text' holds int64, not strings"),
    ],
)
def test_parquet_without_text_column(tmp_path: Path, columns: dict, why: str, pq) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(ValueError, match=rf"other\.parquet: {why}"):
        list(read_file(str(path)))
    stats = ReadStats()
    assert list(read_file(str(path), skip_bad_records=True, stats=stats)) == []
    assert stats.skipped == 2


@pytest.mark.parametrize(
    ("name", "data", "why"),
    [
        (
            "trunc.jsonl.gz",
            gzip.compress(jsonl_bytes([{"text": "x" * 50}] * 200), mtime=0)[:-30],
            "line",
        ),
        ("junk.jsonl.zst", b"not zstd at all", "line 0"),
        ("junk.parquet", b"not parquet", "not a readable parquet file"),
        ("junk.txt.gz", b"not gzip", "cannot read"),
    ],
    ids=[
        "truncated-gzip",
        "junk-zstd",
        "junk-parquet",
        "junk-gzip",
    ],  # the same on every xdist worker
)
def test_corrupt_files_name_the_file(tmp_path: Path, name: str, data: bytes, why: str) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*{why}"):
        list(read_file(str(tmp_path / name), skip_bad_records=True))
