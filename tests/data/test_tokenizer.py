"""Training, loading and using byte-level BPE tokenizers."""

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from loomax.data import load_tokenizer, train_bpe_tokenizer
from loomax.data import tokenizer as tokenizer_module
from loomax.data.tokenizer import EOS_TOKEN, encode_documents, eos_id
from loomax.errors import BadFileError

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    path = tmp_path_factory.mktemp("tok") / "sub" / "tokenizer.json"
    return train_bpe_tokenizer(CORPUS, vocab_size=320, out_path=path), path


def test_trained_tokenizer_is_saved_with_eos(trained: tuple[Tokenizer, Path]) -> None:
    tokenizer, path = trained
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left
    assert 257 < tokenizer.get_vocab_size() <= 320
    assert eos_id(tokenizer) == tokenizer.token_to_id(EOS_TOKEN) == 0


@pytest.mark.parametrize(
    "text",
    ["def add(a, b):\n    return a + b\n", "  héllo wörld → ✓ 日本語\t\r\n", " leading space"],
)
def test_roundtrip_any_text(trained: tuple[Tokenizer, Path], text: str) -> None:
    tokenizer, _ = trained
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text


def test_merges_shorten_seen_text(trained: tuple[Tokenizer, Path]) -> None:
    tokenizer, _ = trained
    text = CORPUS[0]
    assert len(tokenizer.encode(text).ids) < 0.6 * len(text.encode())


def test_load_from_file_or_folder(trained: tuple[Tokenizer, Path]) -> None:
    tokenizer, path = trained
    text = CORPUS[3]
    for where in (path, str(path), path.parent):
        assert load_tokenizer(where).encode(text).ids == tokenizer.encode(text).ids


@pytest.mark.parametrize(
    "damage", ["truncated", "overwritten", "emptied"], ids=["truncated", "overwritten", "emptied"]
)
def test_a_damaged_tokenizer_file_is_a_one_line_user_error(
    trained: tuple[Tokenizer, Path], tmp_path: Path, damage: str
) -> None:
    good = trained[1].read_bytes()
    bad = {
        "truncated": good[: len(good) // 2],
        "overwritten": good[:100] + b"\xff\x00garbage" + good[110:],
        "emptied": b"",
    }[damage]
    path = tmp_path / "tokenizer.json"
    path.write_bytes(bad)
    with pytest.raises(BadFileError, match=rf"tokenizer: {path} is not a readable tokenizer") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value) and "replace it with a good copy" in str(e.value)


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_hub_ids_resolve_from_the_hf_cache_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'org/tiny' is not a local path, and fetching it"):
        load_tokenizer("org/tiny")
    # the layout huggingface_hub leaves in its cache after a download
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    train_bpe_tokenizer(CORPUS, vocab_size=300, out_path=snapshot / "tokenizer.json")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert load_tokenizer("org/tiny").get_vocab_size() == 300


def test_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_bpe_tokenizer(CORPUS, vocab_size=100, out_path=tmp_path / "t.json")


def test_eos_id_alternatives_and_missing() -> None:
    vocab = {"<unk>": 0, "a": 1, "</s>": 2}
    assert eos_id(Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))) == 2
    with pytest.raises(ValueError, match="no end-of-document token"):
        eos_id(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))


@pytest.mark.parametrize("chunk", [2, 512])
def test_encode_documents_appends_eos(
    trained: tuple[Tokenizer, Path], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, _ = trained
    monkeypatch.setattr(tokenizer_module, "ENCODE_CHUNK", chunk)
    documents = CORPUS[:5]
    encoded = encode_documents(tokenizer, documents)
    assert len(encoded) == 5
    for document, ids in zip(documents, encoded, strict=True):
        assert ids.dtype == np.int32
        assert ids.tolist() == tokenizer.encode(document).ids + [0]
    plain = encode_documents(tokenizer, documents, append_eos=False)
    assert [ids.tolist() for ids in plain] == [ids.tolist()[:-1] for ids in encoded]
