"""The command line: subcommands other tests do not cover."""

from __future__ import annotations

import json

import pytest

from loomax.cli import main
from loomax.data.tokenizer import load_tokenizer


def test_tokenizer_train_writes_a_tokenizer_json(tmp_path, tiny_corpus, capsys):
    sources = json.dumps([{"urls": [str(tiny_corpus)]}])
    main(
        [
            "tokenizer",
            "train",
            "--data.train",
            sources,
            "--out",
            str(tmp_path / "tok"),
            "--vocab_size",
            "300",
        ]
    )
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.get_vocab_size() == 300
    assert "trained a byte-level BPE of 300 tokens" in capsys.readouterr().out


def test_tokenizer_needs_train_and_out(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenizer", "fit"])
    assert exit_info.value.code == 2 and "loomax tokenizer train" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenizer", "train"])
    assert exit_info.value.code == 2 and "--out" in capsys.readouterr().err


def test_cache_builds_then_reuses(tmp_path, tiny_corpus, capsys, ray_cluster):
    args = [
        "cache",
        "--data.train",
        json.dumps([{"urls": [str(tiny_corpus)]}]),
        "--data.tokenizer_vocab_size",
        "300",
        "--data.validation_fraction",
        "0.1",
        "--data.cache_dir",
        str(tmp_path / "cache"),
    ]
    main(args)
    first = capsys.readouterr().out
    assert "data.train[0]: train " in first and "validation " in first
    assert "1 of 1 shards tokenized now" in first
    main(args)
    assert "0 of 1 shards tokenized now" in capsys.readouterr().out
