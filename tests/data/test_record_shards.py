"""Streamed sources cut into logical shards of N records as they are read
(`records_per_shard`): a Hugging Face streaming dataset and fsspec URLs build the same cache
as the listed files, and an interrupted build resumes to it."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import fsspec
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.data.config import DataConfig
from loomax.data.hf_datasets import HfSourceConfig
from loomax.data.record_shards import RecordShards
from loomax.data.sources import SourceConfig, source_shards
from loomax.data.streaming import check_streaming
from loomax.data.token_cache import TokenCache, TokenCacheError, build_token_cache
from loomax.data.tokenizer import train_bpe_tokenizer

FILES = 3
PER_SHARD = 7  # records per logical shard: 20 + 25 + 30 = 75 records -> 11 shards, last of 5
DRIVER = Path(__file__).with_name("token_cache_driver.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("record_shards")
    texts = []
    for k in range(FILES):
        docs = [f"file {k} doc {i}: " + "lorem ipsum " * (i % 5) for i in range(20 + 5 * k)]
        with gzip.open(root / f"s{k}.jsonl.gz", "wt") as out:
            out.write("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts += docs
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(texts, 300, tokenizer)
    paths = [str(root / f"s{k}.jsonl.gz") for k in range(FILES)]
    return SimpleNamespace(root=root, paths=paths, texts=texts, tokenizer=tokenizer)


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    """Builds of local caches run shard by shard here (the Ray build is tested elsewhere)."""
    spec = importlib.util.spec_from_file_location("token_cache_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    driver.in_process_builds(monkeypatch.setattr)


def build(shards, corpus, url, **kwargs):
    return build_token_cache(shards, corpus.tokenizer, url, progress=False, **kwargs)


def arrays(url) -> dict[str, np.ndarray]:
    split = TokenCache.open(url)["train"]
    return {"tokens": split.as_numpy(), "offsets": np.asarray(split.offsets())}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The cache of the listed files (one shard per file)."""
    url = tmp_path_factory.mktemp("reference") / "cache"
    spec = importlib.util.spec_from_file_location("token_cache_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    with pytest.MonkeyPatch.context() as patch:
        driver.in_process_builds(patch.setattr)
        info = build(source_shards(SourceConfig(urls=corpus.paths)), corpus, url)
    assert info.shards_total == FILES
    return arrays(url)


def assert_same(url, reference) -> None:
    got = arrays(url)
    for name, expected in reference.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_file_urls_in_logical_shards_build_the_listed_files_cache(corpus, reference, tmp_path):
    source = SourceConfig(urls=[f"file://{p}" for p in corpus.paths], records_per_shard=PER_SHARD)
    shards = RecordShards(source)
    info = build(shards, corpus, tmp_path / "cache")
    assert (info.shards_total, info.shards_tokenized) == (11, 11)
    assert info.shard_documents[shards[10].name] == 75 - 10 * PER_SHARD
    assert shards[3].name.endswith(f":records[{3 * PER_SHARD}:{4 * PER_SHARD}]")
    assert_same(tmp_path / "cache", reference)


def test_memory_urls_and_an_exact_multiple_end_with_an_empty_shard(corpus, reference, tmp_path):
    memory = fsspec.filesystem("memory")
    for k, path in enumerate(corpus.paths):
        memory.pipe(f"/{tmp_path.name}/s{k}.jsonl.gz", Path(path).read_bytes())
    source = SourceConfig(urls=[f"memory://{tmp_path.name}/s*.jsonl.gz"], records_per_shard=25)
    info = build(RecordShards(source), corpus, tmp_path / "cache")
    assert info.shards_total == 4 and info.empty_shards == [RecordShards(source)[3].name]
    assert_same(tmp_path / "cache", reference)


def test_hf_streaming_dataset_builds_the_listed_files_cache(corpus, reference, tmp_path):
    hf = HfSourceConfig(id="json", data_files=corpus.paths, streaming=True)
    source = SourceConfig(hf=hf, records_per_shard=PER_SHARD)
    info = build(RecordShards(source), corpus, tmp_path / "cache")
    assert info.shards_total == 11
    assert_same(tmp_path / "cache", reference)


def test_an_interrupted_streamed_build_resumes_to_the_same_cache(corpus, reference, tmp_path):
    source = SourceConfig(urls=corpus.paths, records_per_shard=PER_SHARD)
    failing = RecordShards(source)[6].name

    def fail(shard) -> None:
        if shard.name == failing:
            raise RuntimeError("fails on purpose")

    cache = tmp_path / "cache"
    with pytest.raises(TokenCacheError, match="fails on purpose"):
        build(RecordShards(source), corpus, cache, before_piece=fail)
    recorded = {p.name: p.stat().st_mtime_ns for p in (cache / "ledger").glob("*.json")}
    assert sorted(recorded) == [f"{i}.json" for i in range(6)]
    read = []

    def count(shard) -> None:
        read.append(shard.index)

    info = build(RecordShards(source), corpus, cache, before_piece=count)
    assert read == list(range(6, 11)) and info.shards_tokenized == 5
    kept = {p.name: p.stat().st_mtime_ns for p in (cache / "ledger").glob("*.json")}
    assert {name: kept.get(name) for name in recorded} == recorded, "finished shards kept"
    assert_same(cache, reference)
    # complete: found as is, nothing read
    again = build(RecordShards(source), corpus, cache, before_piece=count)
    assert again.shards_tokenized == 0 and again.shards_total == 11


def test_max_documents_ends_the_stream(corpus, reference, tmp_path):
    source = SourceConfig(urls=corpus.paths, records_per_shard=PER_SHARD, max_documents=30)
    info = build(RecordShards(source), corpus, tmp_path / "cache", max_documents=30)
    assert info.splits["train"].documents == 30 and info.shards_used == 5
    offsets = reference["offsets"]
    np.testing.assert_array_equal(arrays(tmp_path / "cache")["offsets"], offsets[:31])


def test_records_per_shard_errors():
    with pytest.raises(ValueError, match="`records_per_shard` must be >= 1"):
        SourceConfig(urls=["a.jsonl"], records_per_shard=0)
    streamed = SourceConfig(urls=["a.jsonl"], records_per_shard=10)
    with pytest.raises(TypeError, match="every 10 records: the number of shards"):
        list(RecordShards(streamed))
    check_streaming(DataConfig(train=[streamed], stream_while_building=True))  # trains as it builds
    limited = SourceConfig(urls=["a.jsonl"], records_per_shard=10, max_documents=5)
    with pytest.raises(ConfigError, match=r"data.train\[0\].max_documents cannot be used"):
        check_streaming(DataConfig(train=[limited], stream_while_building=True))
