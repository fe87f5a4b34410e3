"""Malformed files, each as a run's only source: what is skipped is counted and shown, what
is empty is named.

Found by feeding them to a run: a `.jsonl` with a broken line or a record without its text
key (the tokenizer pass ignored `skip_bad_records`), and an empty or whitespace-only
`.jsonl` or `.txt` (a tokenizer was trained from nothing, an empty `.txt` was a document of
only EOS, and the error named `data.train[0]` but none of its files).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from loomax.cli import main
from loomax.data import DataConfig, SourceConfig, build_lm_datasets, report_skipped
from loomax.data.readers import read_file
from loomax.data.report import SkippedRecords, skipped_lines, skipped_summary
from loomax.data.run_tokenizer import prepare_tokenizer
from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.tracking.jsonl import JsonlTracker

GOOD = [
    json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog"})
    for i in range(60)
]
MALFORMED = {
    "broken.jsonl": "\n".join([*GOOD[:3], '{"text": "cut short', *GOOD[3:]]) + "\n",
    "no_key.jsonl": "\n".join([*GOOD[:3], '{"body": "no text here"}', *GOOD[3:]]) + "\n",
}
REASONS = {"broken.jsonl": "line 4: invalid JSON", "no_key.jsonl": "line 4: no key 'text'"}
EMPTY = {"empty.jsonl": "", "blank.jsonl": "  \n\n\t \n", "empty.txt": "", "blank.txt": " \n\n "}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config(tmp_path: Path, *paths: Path, **kwargs) -> DataConfig:
    defaults = {
        "train": [SourceConfig(urls=[str(p) for p in paths])],
        "tokenizer_vocab_size": 300,
        "cache_dir": str(tmp_path / "cache"),
        "validation_fraction": 0.2,
    }
    return DataConfig(**(defaults | kwargs))


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_an_empty_or_blank_file_holds_no_document(tmp_path, name):
    assert list(read_file(str(write(tmp_path, name, EMPTY[name])))) == []


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_the_tokenizer_pass_skips_and_counts_bad_records(tmp_path, name, caplog):
    path = write(tmp_path, name, MALFORMED[name])
    with pytest.raises(ValueError, match=rf"{name}, {REASONS[name]}"):
        prepare_tokenizer(config(tmp_path, path))
    with caplog.at_level(logging.WARNING, logger="loomax.data.dataset"):
        tokenizer = prepare_tokenizer(config(tmp_path, path, skip_bad_records=True))
    assert tokenizer.is_file()
    assert re.search(rf"skipped 1 bad record.*{name}, {REASONS[name]}", caplog.text)


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_a_source_of_one_empty_file_is_named_before_a_tokenizer_is_trained(tmp_path, name):
    path = write(tmp_path, name, EMPTY[name])
    with pytest.raises(
        ValueError,
        match=rf"no documents to train the tokenizer on; its only file: {path} \(empty: no documents\)",
    ):
        prepare_tokenizer(config(tmp_path, path))
    assert not (tmp_path / "cache" / "tokenizers").exists()


def test_report_lines_and_summary():
    skipped = [
        SkippedRecords("data.train[0]", 2, ["a.jsonl, line 4: invalid JSON", "a.jsonl, line 9: x"]),
        SkippedRecords("data.validation[0]", 0),
    ]
    assert skipped_lines(skipped) == [
        "data.train[0]: 2 bad record(s) skipped, first:",
        "  a.jsonl, line 4: invalid JSON",
        "  a.jsonl, line 9: x",
    ]
    assert skipped_summary(skipped) == {
        "data/skipped_records/train[0]": 2,
        "data/skipped_records/validation[0]": 0,
    }


# ------------------------------------------------------------ through the token cache (Ray)
@pytest.mark.usefixtures("ray_cluster")
def test_a_source_with_too_few_tokens_names_its_empty_files(tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe_tokenizer(["some text to learn from"] * 10, 300, tokenizer)
    empty = write(tmp_path, "empty.jsonl", "")
    small = write(tmp_path, "small.jsonl", json.dumps({"text": "hi"}) + "\n")
    blank = write(tmp_path, "blank.txt", "\n")
    data = config(tmp_path, empty, small, blank, tokenizer=str(tokenizer))
    with pytest.raises(ValueError) as error:
        build_lm_datasets(data, seq_len=64)
    message = str(error.value)
    assert message.startswith("data.train[0] has ") and "fewer than seq_len=64" in message
    assert (
        f"2 of its 3 files hold no documents: {empty} (empty: no documents), "
        f"{blank} (empty: no documents), {small} (1 document)"
    ) in message


@pytest.mark.usefixtures("ray_cluster")
def test_an_empty_validation_source_is_named_with_its_files(tmp_path):
    good = write(tmp_path, "good.jsonl", "\n".join(GOOD) + "\n")
    empty = write(tmp_path, "empty.jsonl", "")
    data = config(tmp_path, good, validation=[SourceConfig(urls=[str(empty)])])
    with pytest.raises(ValueError) as error:
        build_lm_datasets(data, seq_len=8)
    message = str(error.value)
    assert message.startswith("the validation data has 0 tokens")
    assert f"data.validation[0]: its only file: {empty} (empty: no documents)" in message


@pytest.mark.usefixtures("ray_cluster")
def test_skipped_records_are_counted_shown_and_recorded(tmp_path, capsys):
    broken = write(tmp_path, "broken.jsonl", MALFORMED["broken.jsonl"])
    no_key = write(tmp_path, "no_key.jsonl", MALFORMED["no_key.jsonl"])
    validation = [{"urls": [str(no_key)]}]
    data = config(
        tmp_path, broken, validation=[SourceConfig(**validation[0])], skip_bad_records=True
    )
    datasets = build_lm_datasets(data, seq_len=8)
    assert [(s.source, s.count) for s in datasets.skipped] == [
        ("data.train[0]", 1),
        ("data.validation[0]", 1),
    ]
    assert datasets.skipped[0].examples[0].startswith(f"{broken}, line 4: invalid JSON")

    tracker = JsonlTracker(tmp_path / "run" / "metrics.jsonl")  # what `loomax train` records
    report_skipped(datasets.skipped, tracker, echo=True)
    tracker.finish()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"data/skipped_records/train[0]": 1, "data/skipped_records/validation[0]": 1}
    shown = [
        f"data.train[0]: 1 bad record(s) skipped, first:\n  {broken}, line 4: invalid JSON",
        f"data.validation[0]: 1 bad record(s) skipped, first:\n  {no_key}, line 4: no key 'text'",
    ]
    out = capsys.readouterr().out
    assert all(line in out for line in shown), out

    main(
        [
            "cache",
            "--data.train",
            json.dumps([{"urls": [str(broken)]}]),
            "--data.validation",
            json.dumps(validation),
            "--data.skip_bad_records",
            "true",
            "--data.tokenizer_vocab_size",
            "300",
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    out = capsys.readouterr().out  # the same caches, found complete: still shown
    assert "0 of 1 shards tokenized now" in out
    assert all(line in out for line in shown), out


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_train_prints_and_records_the_skipped_records(tmp_path, capsys):
    broken = write(tmp_path, "broken.jsonl", MALFORMED["broken.jsonl"])
    main(
        [
            "train",
            "--data.train",
            json.dumps([{"urls": [str(broken)]}]),
            "--data.skip_bad_records",
            "true",
            "--data.tokenizer_vocab_size",
            "300",
            "--data.validation_fraction",
            "0.2",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--model.seq_len",
            "16",
            "--model.hidden_dim",
            "16",
            "--model.num_layers",
            "1",
            "--model.num_heads",
            "2",
            "--trainer.train_batch_size",
            "4",
            "--trainer.num_train_steps",
            "2",
            "--trainer.run_dir",
            str(tmp_path / "run"),
            "--trainer.progress_bar",
            "false",
            "--sample.enabled",
            "false",
        ]
    )
    out = capsys.readouterr().out
    assert (
        f"data.train[0]: 1 bad record(s) skipped, first:\n  {broken}, line 4: invalid JSON" in out
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data/skipped_records/train[0]"] == 1 and summary["final_step"] == 2
