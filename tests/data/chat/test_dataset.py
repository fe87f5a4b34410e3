"""Chat sources into packed rows: the loader's batches, the held-out split, bad records."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from loomax.data.chat.config import ChatConfig
from loomax.data.chat.dataset import build_chat_datasets
from loomax.data.chat.packing import SEGMENTS, WEIGHTS
from loomax.data.config import DataConfig
from loomax.data.loader import BatchLoader
from loomax.data.sources import SourceConfig
from loomax.errors import DataSourceError


@pytest.fixture
def chat_files(tmp_path, repo_root):
    folder = repo_root / "data" / "chat_tiny"
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    with open(folder / "train.jsonl") as f:
        lines = [next(f) for _ in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(lines[:40]))
    (tmp_path / "b.jsonl").write_text("".join(lines[40:]))
    return tmp_path


def config(folder, **chat):
    return DataConfig(
        format="chat",
        tokenizer=str(folder / "tokenizer.json"),
        train=[
            SourceConfig(urls=[str(folder / "a.jsonl")]),
            SourceConfig(urls=[str(folder / "b.jsonl")]),
        ],
        validation_fraction=0.2,
        chat=ChatConfig(**chat),
    )


def test_rows_batches_and_split(chat_files):
    data = build_chat_datasets(config(chat_files), 128)
    a, b = data.train
    assert a.rows.shape[1:] == (3, 128) and len(data.validation) > 0
    # first fit fills rows: far fewer rows than conversations, no token lost
    assert len(a) + len(b) < 60 * 0.8
    again = build_chat_datasets(config(chat_files), 128)
    np.testing.assert_array_equal(again.train[0].rows, a.rows)  # deterministic
    loader = BatchLoader(data.train, 4, seed=3, weights=[1.0, 1.0], prefetch=0)
    batch = loader.batch(5)
    assert batch.shape == (4, 3, 128) and batch.dtype == np.int32
    # resumable: batch k is a function of k alone
    fresh = BatchLoader(data.train, 4, seed=3, weights=[1.0, 1.0], prefetch=0)
    np.testing.assert_array_equal(fresh.batch(5), batch)
    # none: one conversation per row; the same trained tokens
    alone = build_chat_datasets(config(chat_files, packing="none"), 128)
    assert (alone.train[0].rows[:, SEGMENTS] <= 0).all()
    assert alone.train[0].num_trained == a.num_trained == int(a.rows[:, WEIGHTS].sum())


def test_bad_records_name_file_and_line(chat_files):
    with open(chat_files / "b.jsonl", "a") as f:
        f.write(json.dumps({"text": "no turns"}) + "\n")
    with pytest.raises(DataSourceError, match=r"b.jsonl, line 21: no `messages`"):
        build_chat_datasets(config(chat_files), 128)


def test_overlong_conversations_stop_or_are_dropped(chat_files):
    with pytest.raises(DataSourceError, match=r"a.jsonl, line \d+: .* more than model.seq_len 24"):
        build_chat_datasets(config(chat_files), 24)
    with pytest.raises(DataSourceError, match="no conversations"):
        build_chat_datasets(config(chat_files, drop_overlong=True), 8)


def test_chat_needs_a_tokenizer_and_known_settings(chat_files):
    with pytest.raises(ValueError, match="data.format chat needs data.tokenizer"):
        DataConfig(format="chat", tokenizer=None, train=[SourceConfig(urls=["x.jsonl"])])
    with pytest.raises(ValueError, match="data.chat.loss_on must be one of"):
        ChatConfig(loss_on="user")
    with pytest.raises(ValueError, match="data.format must be text or chat"):
        DataConfig(format="dpo")


def test_parquet_chat_files_give_the_jsonl_rows(chat_files):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for name in ("a", "b"):
        lines = (chat_files / f"{name}.jsonl").read_text().splitlines()
        table = pa.table({"messages": [json.loads(line)["messages"] for line in lines]})
        pq.write_table(table, chat_files / f"{name}.parquet")
    want = build_chat_datasets(config(chat_files), 128)
    given = DataConfig(
        format="chat",
        tokenizer=str(chat_files / "tokenizer.json"),
        train=[SourceConfig(urls=[str(chat_files / f"{n}.parquet")]) for n in ("a", "b")],
        validation_fraction=0.2,
    )
    got = build_chat_datasets(given, 128)
    for w, g in zip(want.train + [want.validation], got.train + [got.validation], strict=True):
        np.testing.assert_array_equal(g.rows, w.rows)
