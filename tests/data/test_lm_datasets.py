"""Building train and validation windows from a config, through the Ray-built token cache."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from loomax.data import DataConfig, SourceConfig, build_lm_datasets, load_tokenizer, run_tokenizer
from loomax.data import dataset as dataset_module
from loomax.data.sources import iter_documents

pytestmark = pytest.mark.usefixtures("ray_cluster")

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda"]


def write_corpus(directory: Path, count: int = 40, files: int = 4) -> list[str]:
    """Writes `count` distinct documents into `files` .jsonl shards; returns the texts in order."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(count):
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30))
        texts.append(f"document {i:03d}: {words}\n")
    per_file = -(-count // files)
    for f in range(files):
        lines = [json.dumps({"text": t}) for t in texts[f * per_file : (f + 1) * per_file]]
        (directory / f"part_{f}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return texts


def small_config(tmp_path: Path, **kwargs) -> DataConfig:
    defaults = {
        "train": [SourceConfig(urls=[str(tmp_path / "corpus" / "*.jsonl")])],
        "tokenizer_vocab_size": 300,
        "cache_dir": str(tmp_path / "cache"),
        "validation_fraction": 0.3,
    }
    return DataConfig(**(defaults | kwargs))


def split_documents(stream: np.ndarray, eos: int) -> list[np.ndarray]:
    """The documents of a stream that ends in EOS, without their EOS."""
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[s:e] for s, e in zip(starts, ends, strict=True)]


def train_tokens(data) -> np.ndarray:
    return np.concatenate([d.split.as_numpy() for d in data.train])


def test_windows_are_documents_joined_by_eos(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "corpus", 12)
    (tmp_path / "val.txt").write_text("held out text\n" * 20, encoding="utf-8")
    config = small_config(tmp_path, validation=[SourceConfig(urls=[str(tmp_path / "val.txt")])])
    data = build_lm_datasets(config, seq_len=16)
    expected = np.concatenate([data.tokenizer.encode(t).ids + [data.eos_id] for t in texts])
    (train,) = data.train
    assert train.num_tokens == len(expected)
    usable = len(train) * 16
    assert np.array_equal(train.get_batch(np.arange(len(train))).ravel(), expected[:usable])
    assert data.eos_id == 0
    assert data.vocab_size == data.tokenizer.get_vocab_size() <= 300
    assert Path(data.tokenizer_path).is_file()
    assert data.tokenizer.decode(data.validation[0].tolist()).startswith("held out text")


def test_lazy_windows_equal_in_memory_windows(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    data = build_lm_datasets(small_config(tmp_path), seq_len=16)
    (memory,) = data.train
    lazy = dataset_module.SplitWindows(memory.split, 16, in_memory_bytes=0)
    indices = np.array([3, 0, len(memory) - 1, 3])
    np.testing.assert_array_equal(lazy.get_batch(indices), memory.get_batch(indices))
    assert "tensorstore" in repr(lazy) and "memory" in repr(memory)


def test_held_out_documents_are_disjoint_and_deterministic(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "corpus", 40)
    first = build_lm_datasets(small_config(tmp_path, validation_fraction=0.25), seq_len=8)
    second = build_lm_datasets(
        small_config(tmp_path, validation_fraction=0.25, cache_dir=str(tmp_path / "other")),
        seq_len=8,
    )
    assert np.array_equal(train_tokens(first), train_tokens(second))
    assert np.array_equal(first.validation.tokens, second.validation.tokens)
    decode = first.tokenizer.decode
    train = [decode(d.tolist()) for d in split_documents(train_tokens(first), first.eos_id)]
    validation = [
        decode(d.tolist()) for d in split_documents(first.validation.tokens, first.eos_id)
    ]
    assert 3 <= len(validation) <= 20
    assert len(first.train[0]) == first.train[0].num_tokens // 8  # no window held out
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(texts)


def test_split_does_not_depend_on_where_the_files_lie(tmp_path: Path) -> None:
    """The same files in two directories: the same documents and tokens in each split."""
    texts = write_corpus(tmp_path / "a" / "corpus", 200, files=5)
    write_corpus(tmp_path / "b" / "deeper" / "corpus", 200, files=5)
    data = {}
    for name, root in (("a", tmp_path / "a"), ("b", tmp_path / "b" / "deeper")):
        config = small_config(root, validation_fraction=0.25)
        data[name] = build_lm_datasets(config, seq_len=8)
    a, b = data["a"], data["b"]
    assert a.caches != b.caches  # two caches, built apart
    assert np.array_equal(train_tokens(a), train_tokens(b))
    assert np.array_equal(a.validation.tokens, b.validation.tokens)
    validation = {
        a.tokenizer.decode(d.tolist()) for d in split_documents(a.validation.tokens, a.eos_id)
    }
    assert validation <= set(texts)
    # 200 documents at 0.25: 50 expected; the split is fixed, so this cannot flake
    assert 30 <= len(validation) <= 70


def test_second_build_reuses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus", 20)
    config = small_config(tmp_path)
    first = build_lm_datasets(config, seq_len=8)
    train_tokenizer = run_tokenizer.train_bpe_tokenizer

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer should come from the cache")

    monkeypatch.setattr(run_tokenizer, "train_bpe_tokenizer", no_training)
    train, _ = dataset_module.build_caches(config, first.tokenizer_path, progress=False)
    assert train[0].shards_tokenized == 0  # nothing tokenized again
    second = build_lm_datasets(config, seq_len=16)
    assert second.tokenizer_path == first.tokenizer_path
    assert np.array_equal(train_tokens(second), train_tokens(first))
    assert len(second.train[0]) == second.train[0].num_tokens // 16

    (tmp_path / "corpus" / "part_0.jsonl").write_text(
        '{"text": "a changed document"}\n', encoding="utf-8"
    )
    monkeypatch.setattr(run_tokenizer, "train_bpe_tokenizer", train_tokenizer)
    third = build_lm_datasets(config, seq_len=8)
    assert third.caches != first.caches  # a changed file means a new cache
    assert third.train[0].num_tokens != first.train[0].num_tokens


def test_each_train_source_is_a_dataset(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    write_corpus(tmp_path / "more", 12)
    config = small_config(
        tmp_path,
        train=[
            SourceConfig(urls=[str(tmp_path / "corpus" / "*.jsonl")]),
            SourceConfig(urls=[str(tmp_path / "more" / "*.jsonl")], weight=3.0),
        ],
    )
    data = build_lm_datasets(config, seq_len=8)
    assert len(data.train) == 2 and len(data.caches) == 2
    assert data.num_train_windows == len(data.train[0]) + len(data.train[1])


def test_given_tokenizer_is_used(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    trained = build_lm_datasets(small_config(tmp_path), seq_len=8)
    config = small_config(
        tmp_path, tokenizer=trained.tokenizer_path, cache_dir=str(tmp_path / "c2")
    )
    data = build_lm_datasets(config, seq_len=8)
    assert data.tokenizer_path == trained.tokenizer_path
    assert not (tmp_path / "c2" / "tokenizers").exists()
    assert np.array_equal(train_tokens(data), train_tokens(trained))


def test_too_small_held_out_validation_says_what_to_change(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    with pytest.raises(ValueError) as info:
        build_lm_datasets(small_config(tmp_path, validation_fraction=0.05), seq_len=400)
    message = str(info.value)
    assert "validation data has" in message and "seq_len=400" in message
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
        validation_fraction=0.2,
    )
    data = build_lm_datasets(config, seq_len=64)
    assert len(data.train[0]) > 100 and len(data.validation) >= 1
    assert train_tokens(data).max() < data.vocab_size
    documents = list(iter_documents(source))
    decoded = [
        data.tokenizer.decode(d.tolist())
        for stream in (train_tokens(data), data.validation.tokens)
        for d in split_documents(stream, data.eos_id)
    ]
    assert sorted(decoded) == sorted(documents)


def test_changing_the_split_is_not_served_from_the_cache(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 40)
    small = build_lm_datasets(small_config(tmp_path, validation_fraction=0.2), seq_len=8)
    large = build_lm_datasets(small_config(tmp_path, validation_fraction=0.5), seq_len=8)
    assert large.validation.num_tokens > small.validation.num_tokens
    caches = [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]
    assert len(caches) == 2  # beside each, its released lease record (keeping its fence)


def test_in_memory_cache_builds_without_ray_or_a_local_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``memory://`` cache (how bench/gpu.py trains on a host without Ray) is built in this
    process, and the tokenizer trained for it goes to the temp directory, not to a folder
    named ``memory:`` wherever the run was started."""
    write_corpus(tmp_path / "corpus", 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setitem(sys.modules, "ray", None)  # importing Ray now fails
    config = small_config(tmp_path, cache_dir="memory://in-memory-test")
    data = build_lm_datasets(config, seq_len=8)
    assert data.num_train_windows > 0
    assert not (tmp_path / "memory:").exists()
    assert Path(data.tokenizer_path).is_relative_to(tmp_path / "tmp" / "loomax-tokenizers")


def one_file_corpus(directory: Path, kind: str) -> Path:
    """One file: 60 short documents as .jsonl, or a single document as .txt."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        lines = [json.dumps({"text": f"def f{i}(a, b):\n    return a + {i}\n"}) for i in range(60)]
        path, text = directory / "one.jsonl", "\n".join(lines) + "\n"
    else:
        path = directory / "one.txt"
        text = "".join(f"line {i} of the only document: {WORDS[i % 9]}\n" for i in range(300))
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_one_file_corpus_trains_and_evaluates_with_the_defaults(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The documents held out of one small file make no window: the last windows of its
    token stream are held out instead, the same on every build, and the log says so."""
    path = one_file_corpus(tmp_path / "corpus", kind)
    builds = []
    for name in ("a", "b"):
        config = DataConfig(train=[SourceConfig(urls=[str(path)])], cache_dir=str(tmp_path / name))
        with caplog.at_level("INFO", logger="loomax.data.dataset"):
            builds.append(build_lm_datasets(config, seq_len=128))
    first, second = builds
    (train,) = first.train
    assert len(train) >= 1 and len(first.validation) >= 1
    stream = train.split.as_numpy()
    used = (len(train) + len(first.validation)) * 128
    assert used <= len(stream) < used + 128  # every whole window is in exactly one split
    assert np.array_equal(
        train.get_batch(np.arange(len(train))).ravel(), stream[: len(train) * 128]
    )
    assert np.array_equal(first.validation.tokens, stream[len(train) * 128 : used])
    assert np.array_equal(
        second.train[0].get_batch(np.arange(len(train))), train.get_batch(np.arange(len(train)))
    )
    assert np.array_equal(second.validation.tokens, first.validation.tokens)
    assert "held out" in caplog.text and f"last {len(first.validation)} of" in caplog.text


def test_tokenizer_is_trained_on_the_train_split_only(tmp_path: Path) -> None:
    """A rare word in a held-out document does not become a vocabulary entry; in a
    training document it does."""
    from loomax.data.token_cache import is_held_out

    fraction, rare = 0.3, "qqzzxxjj"
    held = next(i for i in range(40) if is_held_out(0, i, fraction, run_tokenizer.HOLDOUT_SEED))
    kept = next(i for i in range(40) if not is_held_out(0, i, fraction, run_tokenizer.HOLDOUT_SEED))
    vocabularies = {}
    for name, position in (("held", held), ("kept", kept)):
        root = tmp_path / name
        texts = write_corpus(root / "corpus", 40, files=1)
        texts[position] = f"{rare} " * 200 + "\n"
        lines = [json.dumps({"text": t}) for t in texts]
        (root / "corpus" / "part_0.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        config = small_config(root, validation_fraction=fraction, tokenizer_vocab_size=400)
        path = run_tokenizer.prepare_tokenizer(config)
        vocabularies[name] = load_tokenizer(path).get_vocab()
    assert any(rare in token for token in vocabularies["kept"])
    assert not any(rare in token for token in vocabularies["held"])
    # the cache holds that document out too: the tokenizer saw exactly the train split
    data = build_lm_datasets(
        small_config(tmp_path / "held", validation_fraction=fraction, tokenizer_vocab_size=400),
        seq_len=8,
    )
    validation = split_documents(data.validation.tokens, data.eos_id)
    assert f"{rare} " * 200 + "\n" in [data.tokenizer.decode(d.tolist()) for d in validation]


def test_tokenizer_cache_key_depends_on_the_held_out_documents(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", 20)
    paths = {
        run_tokenizer.prepare_tokenizer(small_config(tmp_path, validation_fraction=f))
        for f in (0.2, 0.5)
    }
    given = small_config(
        tmp_path, validation=[SourceConfig(urls=[str(tmp_path / "corpus" / "part_0.jsonl")])]
    )
    paths.add(run_tokenizer.prepare_tokenizer(given))
    assert len(paths) == 3


def test_tokenizer_documents_are_the_train_split(tmp_path: Path) -> None:
    """With shards, `max_documents` cutting one short and a hold-out: the documents the BPE
    reads are exactly those of the cache's train split."""
    write_corpus(tmp_path / "corpus", 40, files=4)
    source = SourceConfig(urls=[str(tmp_path / "corpus" / "*.jsonl")], max_documents=25)
    config = small_config(tmp_path, train=[source])
    data = build_lm_datasets(config, seq_len=8)
    train = [data.tokenizer.decode(d.tolist()) for d in split_documents(train_tokens(data), 0)]
    assert list(run_tokenizer.tokenizer_documents(config)) == train
