"""The fast (tiktoken) encoder: the tokenizer's own ids, or no fast encoder and the reason why."""

import json
import logging
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from loomax.data import DataConfig
from loomax.data import fast_encoder as fe
from loomax.data.dataset import build_caches
from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.data.tokenizer import encode_documents, train_bpe_tokenizer

PIECES = [
    "the", "model's", "don't", "WE'LL", "they'd", "I'm", "naïve", "Ünïcödé", "ß", "数据集",
    "日本語の", "한국어", "Привет", "مرحبا", "🙂", "👍🏽", "👨‍👩‍👧", "12345", "3.14", "x²",
    "  ", "   ", "\n", "\n\n", "\t", "\t\t", " \n ", "\r\n", "<|endoftext|>", "a<|endoftext|>b",
    "def f(x):\n    return x", "$%^&*", "\u00a0", "\u3000",
]  # fmt: skip


def _documents(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    docs = ["", " ", "<|endoftext|>", "<|endoftext|><|endoftext|>", "\n\n\n   \t"]
    docs += ["x" * 3000, " " * 2000 + "a", "ab" * 4000, "é" * 1500]  # tiktoken's long-piece path
    docs += ["".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(rng.randint(0, 60)))
             for _ in range(count)]  # fmt: skip
    return docs


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("fast") / "tokenizer.json"
    return train_bpe_tokenizer(_documents(0, 400), 700, path)


def hf_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch_fast(texts)]


@pytest.mark.parametrize("threads", ["1", "2"])
def test_fast_encoder_gives_the_tokenizers_ids(trained, monkeypatch, threads) -> None:
    monkeypatch.setenv("RAYON_NUM_THREADS", threads)  # one thread: a loop; more: a pool
    encoder = fe.fast_encoder(trained)
    assert encoder is not None
    texts = _documents(1, 300)
    assert encoder.encode_batch(texts) == hf_ids(trained, texts)
    eos_inside = encoder.encode_batch(["a<|endoftext|>b"])[0]
    assert trained.token_to_id("<|endoftext|>") in eos_inside  # split out, as HF does
    fast = [a.tolist() for a in encode_documents(trained, texts, fast=encoder)]
    assert fast == [a.tolist() for a in encode_documents(trained, texts)]


def test_lone_surrogates_fail_as_the_tokenizer_fails(trained) -> None:
    encoder = fe.fast_encoder(trained)
    with pytest.raises(TypeError):
        trained.encode_batch_fast(["a\ud800b"])
    with pytest.raises(TypeError):  # tiktoken alone would encode it as U+FFFD
        encoder.encode_batch(["fine", "a\ud800b"])


def _variant(trained: Tokenizer, change) -> Tokenizer:
    spec = json.loads(trained.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _normalizer(spec):
    spec["normalizer"] = json.loads(normalizers.NFKC().__getstate__())


def _dropout(spec):
    spec["model"]["dropout"] = 0.1


def _prefix_space(spec):
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _swap_ids(spec):
    """Swaps the ids of the tokens of the first and last merges (ids out of merge order)."""
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    first, last = (
        "".join(m.split(" ") if isinstance(m, str) else m) for m in (merges[0], merges[-1])
    )
    vocab[first], vocab[last] = vocab[last], vocab[first]


@pytest.mark.parametrize(
    "change, reason",
    [
        (_normalizer, "normalizer"),
        (_dropout, "dropout"),
        (_prefix_space, "add_prefix_space"),
        (_swap_ids, "out of id order"),
    ],
)
def test_unprovable_tokenizers_fall_back_with_a_reason(trained, caplog, change, reason) -> None:
    tokenizer = _variant(trained, change)
    with caplog.at_level(logging.DEBUG, logger=fe.__name__):
        assert fe.fast_encoder(tokenizer) is None
    assert reason in caplog.text
    if change is not _dropout:  # dropout draws other ids on every call
        texts = _documents(2, 50)
        got = encode_documents(tokenizer, texts, fast=fe.fast_encoder(tokenizer))
        assert [a.tolist() for a in got] == [ids + [0] for ids in hf_ids(tokenizer, texts)]


def test_ids_out_of_merge_order_would_give_other_ids(trained) -> None:
    """What the merge-order check guards: tiktoken on such a vocab gives other ids than HF."""
    tokenizer = _variant(trained, _swap_ids)
    texts = _documents(3, 200)
    unchecked = fe._encoding(json.loads(tokenizer.to_str()))
    assert [unchecked.encode(t, allowed_special="all") for t in texts] != hf_ids(tokenizer, texts)


def test_a_non_bpe_model_falls_back(caplog) -> None:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with caplog.at_level(logging.DEBUG, logger=fe.__name__):
        assert fe.fast_encoder(tokenizer) is None
    assert "WordLevel, not BPE" in caplog.text


def test_a_cache_built_fast_is_byte_identical(trained, tmp_path: Path) -> None:
    docs = _documents(4, 120)
    with (tmp_path / "a.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    trained.save(str(tmp_path / "tokenizer.json"))
    shards = source_shards(SourceConfig(urls=[str(tmp_path / "a.jsonl")]))
    caches = {}
    for fast in (True, False):
        out = tmp_path / f"cache-{fast}"
        build_token_cache(
            shards, tmp_path / "tokenizer.json", out, progress=False, fast_encoder=fast
        )
        caches[fast] = {
            p.relative_to(out): p.read_bytes()
            for p in sorted(out.rglob("*"))
            if p.is_file() and "tokens" in p.parts
        }
        encoder = json.loads((out / "ledger" / "0.json").read_text())["encoder"]
        assert encoder == ("tiktoken" if fast else "tokenizers")
    assert caches[True] and caches[True] == caches[False]


@pytest.mark.parametrize("setting, encoder", [("auto", "tiktoken"), ("off", "tokenizers")])
def test_data_fast_encoder_reaches_the_build(trained, tmp_path: Path, setting, encoder) -> None:
    with (tmp_path / "a.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in _documents(5, 40))
    trained.save(str(tmp_path / "tokenizer.json"))
    config = DataConfig(
        train=[SourceConfig(urls=[str(tmp_path / "a.jsonl")])],
        cache_dir=str(tmp_path / "caches"),
        fast_encoder=setting,
    )
    build_caches(config, tmp_path / "tokenizer.json", progress=False, kinds=("train",))
    [entry] = (tmp_path / "caches").rglob("ledger/0.json")
    assert json.loads(entry.read_text())["encoder"] == encoder
