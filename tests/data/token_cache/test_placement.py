"""Where shards are tokenized: a small local corpus with no Ray running is built in this
process (no cluster start); in a Ray worker the tokenizer gets the node's cores / Ray CPUs
threads."""

from __future__ import annotations

import json
import sys

import pytest

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache, placement
from loomax.data.token_cache.build import BuildPlan
from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.distributed import RayConfig
from loomax.storage import Directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    docs = [f"doc {i}: " + "abc " * (i % 4) for i in range(30)]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_bpe_tokenizer(docs, 280, root / "tokenizer.json")
    return root


def plan(corpus, url: str) -> BuildPlan:
    shards = source_shards(SourceConfig(urls=[str(corpus / "a.jsonl")]))
    return BuildPlan(Directory(url), shards, {}, "key", corpus / "tokenizer.json", {}, False)


def test_a_small_local_corpus_is_built_here_without_ray(corpus, tmp_path, monkeypatch):
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "this module runs with no Ray connected"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    url = str(tmp_path / "cache")
    assert placement.runs_here(plan(corpus, url), RayConfig())
    assert not placement.runs_here(plan(corpus, url), RayConfig(address="127.0.0.1:1"))
    monkeypatch.setattr(placement, "SMALL_BUILD_BYTES", 100)  # the file is larger
    assert not placement.runs_here(plan(corpus, url), RayConfig())
    monkeypatch.undo()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    shards = source_shards(SourceConfig(urls=[str(corpus / "a.jsonl")]))
    info = build_token_cache(shards, corpus / "tokenizer.json", url, progress=False)
    assert info.splits["train"].documents == 30 and info.nodes == {}  # no Ray node did it
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "no Ray was started"
