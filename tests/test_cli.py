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


# --------------------------------------------------------------------------- behaviour of every command

CONFIG_COMMANDS = [
    ["train"],
    ["cache"],
    ["tokenizer", "train"],
    ["bench"],
    ["schedule"],
    ["ladder", "dry-run"],
    ["ladder", "run"],
    ["ladder", "results"],
]
OTHER_COMMANDS = [["export"], ["generate"], ["eval"], ["launch"], ["tokenizer"], ["ladder"]]


def _exit(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.mark.parametrize("command", CONFIG_COMMANDS + OTHER_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_answers_help(command, flag, capsys):
    code, out, err = _exit([*command, flag], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"usage: loomax {' '.join(command)}")
    if command in CONFIG_COMMANDS:
        assert "--config_path FILE" in out and "--section.field VALUE" in out
        assert "docs/reference/config.md" in out


def test_help_after_overrides_and_launch_options(capsys):
    code, out, _ = _exit(["train", "--trainer.num_train_steps", "3", "--help"], capsys)
    assert code == 0 and out.startswith("usage: loomax train")
    code, out, _ = _exit(["launch", "--target", "tpu", "--help", "--", "train"], capsys)
    assert code == 0 and "--tpu_name" in out and "--dry_run" in out


def test_top_level_usage_and_version(capsys):
    code, out, err = _exit(["--help"], capsys)
    assert code == 0 and out.startswith("usage: loomax") and err == ""
    for name in ("train", "cache", "tokenizer", "bench", "export", "generate", "eval", "launch"):
        assert f"\n  {name} " in out
    assert "loomax COMMAND --help" in out
    code, out, err = _exit([], capsys)
    assert code == 2 and out == "" and err.startswith("usage: loomax")
    from importlib.metadata import version

    code, out, err = _exit(["--version"], capsys)
    assert code == 0 and out == f"loomax {version('loomax')}\n"


def _one_error_line(err: str, prog: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def test_unknown_command_and_unknown_flag(capsys):
    code, _, err = _exit(["frobnicate"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "unknown command 'frobnicate'" in _one_error_line(err, "loomax")
    code, _, err = _exit(["train", "--no_such_flag", "1"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--no_such_flag" in _one_error_line(err, "loomax train")
    code, _, err = _exit(["train", "--trainer.num_train_steps", "many"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "trainer.num_train_steps" in _one_error_line(err, "loomax train")
    code, _, err = _exit(["tokenizer", "train", "--vocab_size", "x", "--out", "o"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--vocab_size" in _one_error_line(err, "loomax tokenizer train")


def test_a_bad_record_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    code, _, err = _exit(
        [
            "train",
            "--data.train",
            json.dumps([{"urls": [str(bad)]}]),
            "--data.skip_bad_records",
            "false",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--trainer.run_dir",
            str(tmp_path / "run"),
        ],
        capsys,
    )
    assert code == 2
    assert f"{bad}, line 2: invalid JSON" in _one_error_line(err, "loomax train")


def test_a_bug_keeps_its_traceback(monkeypatch):
    import loomax.train_lm

    def broken(config):
        raise RuntimeError("a bug")

    monkeypatch.setattr(loomax.train_lm, "train_lm", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train"])


def test_missing_tracker_package_in_a_real_run(tmp_path, tiny_corpus):
    """`loomax train` as a process: a tracker whose package is absent ends in one line, exit 2,
    before any work (no tokenizer trained, no token cache written)."""
    import subprocess
    import sys

    block = "import sys; sys.modules['tensorboard'] = None; sys.argv[0] = 'loomax'; "
    args = {
        "data.train": json.dumps([{"urls": [str(tiny_corpus)]}]),
        "data.tokenizer_vocab_size": "300",
        "data.cache_dir": str(tmp_path / "cache"),
        "model.seq_len": "32",
        "model.hidden_dim": "32",
        "model.num_layers": "1",
        "model.num_heads": "2",
        "trainer.train_batch_size": "4",
        "trainer.num_train_steps": "2",
        "trainer.run_dir": str(tmp_path / "run"),
        "trainer.tracker": "{type: tensorboard}",
        "trainer.ray.num_cpus": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", block + "from loomax.cli import main; main()", "train"]
        + [x for k, v in args.items() for x in (f"--{k}", v)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr, "loomax train")
    assert (
        "trainer.tracker type: tensorboard" in line and "pip install 'loomax[tensorboard]'" in line
    )
    assert not (tmp_path / "cache").exists()
