"""Building train and validation windows from a config, through the cache."""

from pathlib import Path

import numpy as np
import pytest

from loomax.data import DataConfig, SourceConfig, build_lm_datasets
from loomax.data import dataset as dataset_module
from loomax.data.sources import iter_documents
from loomax.data.split import held_out_split
from loomax.data.tokenizer import encode_documents

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda"]


def write_corpus(directory: Path, count: int = 40) -> list[str]:
    """Writes `count` distinct .txt documents and returns their texts in sorted-path order."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(count):
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30))
        texts.append(f"document {i:03d}: {words}\n")
        (directory / f"doc_{i:03d}.txt").write_text(texts[-1], encoding="utf-8")
    return texts


def small_config(tmp_path: Path, **kwargs) -> DataConfig:
    defaults = {
        "train": [SourceConfig(urls=[str(tmp_path / "corpus" / "*.txt")])],
        "tokenizer_vocab_size": 300,
        "cache_dir": str(tmp_path / "cache"),
        "validation_fraction": 0.1,
    }
    return DataConfig(**(defaults | kwargs))


def split_documents(stream: np.ndarray, eos: int) -> list[np.ndarray]:
    """The documents of a stream that ends in EOS, without their EOS."""
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[s:e] for s, e in zip(starts, ends, strict=True)]


def test_windows_are_documents_joined_by_eos(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "corpus", 12)
    (tmp_path / "val.txt").write_text("held out text\n" * 20, encoding="utf-8")
    config = small_config(tmp_path, validation=[SourceConfig(urls=[str(tmp_path / "val.txt")])])
    data = build_lm_datasets(config, seq_len=16)
    expected = np.concatenate([data.tokenizer.encode(t).ids + [data.eos_id] for t in texts])
    usable = len(data.train) * 16
    assert data.train.num_tokens == len(expected)
    assert np.array_equal(
        data.train.get_batch(np.arange(len(data.train))).ravel(), expected[:usable]
    )
    assert data.eos_id == 0
    assert data.vocab_size == data.tokenizer.get_vocab_size() <= 300
    assert Path(data.tokenizer_path).is_file()
    assert data.tokenizer.decode(data.validation[0].tolist()).startswith("held out text")


def test_held_out_split_is_disjoint_by_document_and_deterministic(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "corpus", 40)
    first = build_lm_datasets(small_config(tmp_path), seq_len=8)
    second = build_lm_datasets(small_config(tmp_path, cache_dir=str(tmp_path / "other")), seq_len=8)
    assert np.array_equal(first.train.tokens, second.train.tokens)
    assert np.array_equal(first.validation.tokens, second.validation.tokens)

    decode = first.tokenizer.decode
    train = [decode(d.tolist()) for d in split_documents(first.train.tokens, first.eos_id)]
    validation = [
        decode(d.tolist()) for d in split_documents(first.validation.tokens, first.eos_id)
    ]
    assert len(validation) == 4
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(texts)


def test_held_out_split_indices() -> None:
    train, validation = held_out_split(100, 0.05)
    assert len(validation) == 5
    assert sorted(np.concatenate([train, validation]).tolist()) == list(range(100))
    assert np.array_equal(held_out_split(100, 0.05)[1], validation)
    assert len(held_out_split(3, 0.001)[1]) == 1
    assert len(held_out_split(2, 0.99)[0]) == 1
    with pytest.raises(ValueError, match="data.validation"):
        held_out_split(1, 0.5)


def test_second_build_reuses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus", 20)
    config = small_config(tmp_path)
    first = build_lm_datasets(config, seq_len=8)
    train_tokenizer = dataset_module.train_bpe_tokenizer
    encoded: list[int] = []

    def counting_encode(tokenizer, documents, append_eos=True):
        encoded.append(len(documents))
        return encode_documents(tokenizer, documents, append_eos)

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer should come from the cache")

    monkeypatch.setattr(dataset_module, "encode_documents", counting_encode)
    monkeypatch.setattr(dataset_module, "train_bpe_tokenizer", no_training)
    second = build_lm_datasets(config, seq_len=16)
    assert encoded == []
    assert second.tokenizer_path == first.tokenizer_path
    assert np.array_equal(second.train.tokens, first.train.tokens)
    assert len(second.train) == first.train.num_tokens // 16

    (tmp_path / "corpus" / "doc_000.txt").write_text("a changed document\n", encoding="utf-8")
    monkeypatch.setattr(dataset_module, "train_bpe_tokenizer", train_tokenizer)
    third = build_lm_datasets(config, seq_len=8)
    assert encoded == [20]
    assert third.train.num_tokens != first.train.num_tokens


def test_incomplete_cache_entry_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus", 10)
    config = small_config(tmp_path)
    first = build_lm_datasets(config, seq_len=8)
    (meta,) = (tmp_path / "cache" / "tokens").glob("*/meta.json")
    meta.unlink()
    (meta.parent / "train.npy").write_bytes(b"garbage")
    second = build_lm_datasets(config, seq_len=8)
    assert meta.is_file()
    assert np.array_equal(second.train.tokens, first.train.tokens)
    assert not list((tmp_path / "cache").rglob("*.tmp-*"))


def test_given_tokenizer_is_used(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 10)
    trained = build_lm_datasets(small_config(tmp_path), seq_len=8)
    config = small_config(
        tmp_path, tokenizer=trained.tokenizer_path, cache_dir=str(tmp_path / "c2")
    )
    data = build_lm_datasets(config, seq_len=8)
    assert data.tokenizer_path == trained.tokenizer_path
    assert not (tmp_path / "c2" / "tokenizers").exists()
    assert np.array_equal(data.train.tokens, trained.train.tokens)


def test_too_small_held_out_validation_says_what_to_change(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    with pytest.raises(ValueError) as info:
        build_lm_datasets(small_config(tmp_path), seq_len=200)
    message = str(info.value)
    assert "validation data has" in message and "seq_len=200" in message
    assert "data.validation_fraction" in message


def test_too_small_validation_source_says_what_to_change(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 10)
    (tmp_path / "val.txt").write_text("tiny", encoding="utf-8")
    config = small_config(tmp_path, validation=[SourceConfig(urls=[str(tmp_path / "val.txt")])])
    with pytest.raises(
        ValueError, match=r"validation data has \d+ tokens.*seq_len=16.*`data.validation`"
    ):
        build_lm_datasets(config, seq_len=16)


def test_embedded_stdlib_end_to_end(tmp_path: Path) -> None:
    source = SourceConfig(embedded="python_stdlib", max_documents=30)
    config = DataConfig(
        train=[source],
        tokenizer_vocab_size=400,
        cache_dir=str(tmp_path / "cache"),
        validation_fraction=0.1,
    )
    data = build_lm_datasets(config, seq_len=64)
    assert len(data.train) > 100 and len(data.validation) >= 1
    assert data.train.tokens.max() < data.vocab_size
    documents = list(iter_documents(source))
    decoded = [
        data.tokenizer.decode(d.tolist())
        for stream in (data.train.tokens, data.validation.tokens)
        for d in split_documents(stream, data.eos_id)
    ]
    assert sorted(decoded) == sorted(documents)


def test_changing_the_split_is_not_served_from_the_cache(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 40)
    small = build_lm_datasets(small_config(tmp_path, validation_fraction=0.1), seq_len=8)
    large = build_lm_datasets(small_config(tmp_path, validation_fraction=0.25), seq_len=8)
    assert large.validation.num_tokens > small.validation.num_tokens
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2
