"""The command line: subcommands other tests do not cover."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loomax.cli import INTERNAL_ERROR, main, steps_line
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
    ["rl"],
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


@pytest.mark.parametrize("error", [ValueError, FileNotFoundError, RuntimeError])
def test_a_bug_keeps_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys, error):
    # A plain ValueError is a bug like any other: not a one-line usage error with exit 2.
    import loomax.train_lm

    def broken(config):
        raise error("a bug deep inside")

    monkeypatch.setattr(loomax.train_lm, "train_lm", broken)
    code, _, err = _exit(["train"], capsys)
    assert code == 1
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert f"{error.__name__}: a bug deep inside" in err
    assert err.strip().splitlines()[-1] == f"loomax train: {INTERNAL_ERROR}"
    assert ": error: " not in err


def test_a_failed_run_is_one_line_with_exit_code_1(monkeypatch, capsys):
    import loomax.train_lm
    from loomax.hooks import NonFiniteLossError

    def diverged(config):
        raise NonFiniteLossError("training loss is nan at step 7; stopping")

    monkeypatch.setattr(loomax.train_lm, "train_lm", diverged)
    code, _, err = _exit(["train"], capsys)
    assert code == 1 and "Traceback" not in err
    assert _one_error_line(err, "loomax train").endswith("training loss is nan at step 7; stopping")


def _hf_directory(path, config: dict):
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({"x": np.zeros(1, np.float32)}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (  # found when the schedule is built, not when the config is parsed
            ["schedule", "--trainer.num_train_steps", "10", "--optimizer.cycles", "[5, 3]"],
            "optimizer.cycles must be increasing steps in (0, 10]",
        ),
        (["generate", "--checkpoint", "{tmp}/missing", "--prompt", "x"], "does not exist"),
        (
            ["export", "--checkpoint", "{bert}", "--out", "{tmp}/out"],
            "config.json: model_type 'bert' is not supported",
        ),
        (["generate", "--checkpoint", "{bert}", "--prompt", "x", "--top_p", "2"], "--top_p"),
        (["launch", "--target", "local", "train"], "missing `-- <loomax command>`"),
        (["ladder", "dry-run", "--size", "7M"], "--size 7M is not one of ladder.sizes"),
    ],
    ids=["schedule", "missing checkpoint", "bad HF directory", "sampling flag", "launch", "ladder"],
)
def test_bad_input_found_after_parsing_is_one_line(tmp_path, capsys, args, message):
    bert = _hf_directory(tmp_path / "bert", {"model_type": "bert", "vocab_size": 10})
    args = [a.format(tmp=tmp_path, bert=bert) for a in args]
    code, _, err = _exit(args, capsys)
    prog = " ".join(["loomax", *args[:2]] if args[0] == "ladder" else ["loomax", args[0]])
    assert code == 2 and message in _one_error_line(err, prog)


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


def test_tokenizer_train_leaves_the_validation_documents_out(tmp_path):
    """`loomax tokenizer train` (the demo's first command) sees only the documents the
    train split keeps: a word only in a held-out document gets no vocabulary entry."""
    from loomax.data import dataset as dataset_module
    from loomax.data.token_cache import is_held_out

    fraction, rare = 0.3, "qqzzxxjj"
    held = next(i for i in range(40) if is_held_out(0, i, fraction, dataset_module.HOLDOUT_SEED))
    texts = [f"document {i} about the weather and some words\n" for i in range(40)]
    texts[held] = f"{rare} " * 200 + "\n"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    args = ["tokenizer", "train", "--data.train", json.dumps([{"urls": [str(corpus)]}])]
    args += ["--data.validation_fraction", str(fraction), "--vocab_size", "400"]
    main([*args, "--out", str(tmp_path / "tok")])
    assert not any(rare in t for t in load_tokenizer(tmp_path / "tok").get_vocab())
    main([*args, "--data.validation_fraction", "0.01", "--out", str(tmp_path / "all")])
    if not is_held_out(0, held, 0.01, dataset_module.HOLDOUT_SEED):  # now in the train split
        assert any(rare in t for t in load_tokenizer(tmp_path / "all").get_vocab())


def test_the_last_line_says_how_many_steps_ran_and_what_stopped_the_run():
    assert steps_line(500, 500, None) == "steps: 500 of 500"
    guard = steps_line(198, 500, "trainer.max_train_time (0:04:00) reached")
    assert guard.startswith(
        "steps: 198 of 500, stopped early by the time guard: trainer.max_train_time (0:04:00) "
        "reached (a slower or busier machine;"
    )
    assert "--trainer.max_train_time null" in guard and "docs/quickstart.md" in guard
    assert steps_line(7, 10, "signal SIGTERM") == "steps: 7 of 10, stopped early: signal SIGTERM"
