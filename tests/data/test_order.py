"""`data.stream_while_building: auto` (the default): which order a run uses, decided from the
config and the sizes of the listed files alone, and the line saying why."""

from __future__ import annotations

import gzip
import json

import pytest

from loomax.config import ConfigError, parse_config
from loomax.data.config import DataConfig
from loomax.data.hf_datasets import HfSourceConfig
from loomax.data.order import COMPRESSED_FACTOR, choose_order
from loomax.data.sources import SourceConfig
from loomax.lm import TrainLmConfig


def test_the_demo_keeps_the_global_shuffle(repo_root):
    """The shipped demo (`config/quickstart.yaml`, the stdlib's ~10 MB) is below the size at
    which `auto` streams: it trains in the global order it always had."""
    data = parse_config(TrainLmConfig, repo_root / "config" / "quickstart.yaml").data
    assert data.stream_while_building == "auto"
    choice = choose_order(data)
    assert not choice.streaming
    assert "at most data.stream_auto_mb=64" in choice.reason
    line = choice.describe(data.stream_chunk_shards)
    assert line.startswith("data order: the global shuffle") and "because" in line


def test_auto_streams_above_the_size_counting_compressed_files_4x(tmp_path):
    text = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(300))
    plain, packed = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    stored = packed.stat().st_size
    between = 2 * stored / 1e6  # above the gz file's size, below 4x it
    on_disk = DataConfig(train=[SourceConfig(urls=[str(packed)])], stream_auto_mb=between)
    choice = choose_order(on_disk)
    assert choice.streaming and "above data.stream_auto_mb" in choice.reason
    assert f"~{COMPRESSED_FACTOR * stored / 1e6:,.1f} MB of text" in choice.reason
    small = DataConfig(train=[SourceConfig(urls=[str(plain)])], stream_auto_mb=10)
    assert not choose_order(small).streaming
    both = DataConfig(
        train=[SourceConfig(urls=[str(plain)]), SourceConfig(urls=[str(packed)])],
        stream_auto_mb=(len(text) + 2 * stored) / 1e6,  # only the sum of the sources is above
    )
    assert choose_order(both).streaming


def test_auto_streams_sources_read_as_streams_and_not_where_streaming_cannot(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    urls = [str(tmp_path / "a.jsonl")]
    stream = SourceConfig(urls=urls, records_per_shard=10)
    choice = choose_order(DataConfig(train=[SourceConfig(urls=urls), stream]))
    assert choice.streaming and "data.train[1] is read as a stream" in choice.reason
    hub = SourceConfig(hf=HfSourceConfig(id="org/never-fetched", streaming=True))
    assert choose_order(DataConfig(train=[hub])).streaming  # decided without the network
    limited = DataConfig(train=[stream, SourceConfig(urls=urls, max_documents=5)], stream_auto_mb=0)
    choice = choose_order(limited)
    assert not choice.streaming and "data.train[1] sets max_documents" in choice.reason
    choice = choose_order(DataConfig(train=[stream]), epochs=True)
    assert not choice.streaming and "num_train_epochs" in choice.reason
    assert choose_order(DataConfig(train=[stream], stream_while_building=False)).reason == (
        "data.stream_while_building is false"
    )
    forced = choose_order(DataConfig(train=[SourceConfig(urls=urls)], stream_while_building=True))
    assert forced.streaming and "training while the token caches build" in forced.describe(8)


def test_the_order_depends_on_the_config_not_on_the_caches(tmp_path):
    """The same config decides alike before and after its cache is built (and elsewhere)."""
    from loomax.data.dataset import build_caches
    from loomax.data.run_tokenizer import prepare_tokenizer

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 9}) + "\n" for i in range(60)))
    config = DataConfig(
        train=[SourceConfig(urls=[str(path)])],
        tokenizer_vocab_size=260,
        cache_dir=str(tmp_path / "cache"),
        stream_auto_mb=0.001,
    )
    before = choose_order(config)
    build_caches(config, prepare_tokenizer(config), progress=False)
    assert choose_order(config) == before and before.streaming


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="data.stream_while_building must be true, false or auto"):
        parse_config(TrainLmConfig, None, ["--data.stream_while_building", "sometimes"])
    with pytest.raises(ConfigError, match="data.stream_auto_mb must be >= 0"):
        parse_config(TrainLmConfig, None, ["--data.stream_auto_mb", "-1"])
