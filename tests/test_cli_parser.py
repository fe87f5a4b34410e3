"""loomax.cli_parser.given_values: which keys a run's YAML (its !includes followed), its
--overlay files and its flags set, the rest keeping their defaults."""

from __future__ import annotations

from loomax.cli_parser import given_values
from loomax.lm import TrainLmConfig


def test_given_values_are_the_keys_the_file_overlays_and_flags_set(tmp_path):
    (tmp_path / "model.yaml").write_text("type: llama\nrope: {theta: 500000.0}\n")
    (tmp_path / "run.yaml").write_text("model: !include model.yaml\ntrainer: {seed: 3}\n")
    (tmp_path / "overlay.yaml").write_text("trainer:\n  mesh: {data: 2}\n")
    flags = ["--model.seq_len", "64", "--overlay", str(tmp_path / "overlay.yaml")]
    flags += ["--model.moe={num_experts: 4}", "--trainer.initialize_from_hf", "/ckpt"]
    given = given_values(TrainLmConfig, str(tmp_path / "run.yaml"), flags)
    assert given == {
        ("model", "type"): "llama",
        ("model", "rope", "theta"): 500000.0,
        ("trainer", "seed"): 3,
        ("model", "seq_len"): "64",
        ("trainer", "mesh", "data"): "2",
        ("model", "moe", "num_experts"): 4,
        ("trainer", "initialize_from_hf"): "/ckpt",
    }
    assert given_values(TrainLmConfig, None, []) == {}


def test_a_file_that_cannot_be_read_is_left_to_parse_config(tmp_path, capsys):
    from loomax import cli

    (tmp_path / "bad.yaml").write_text("trainer: [unclosed\n")
    assert given_values(TrainLmConfig, str(tmp_path / "bad.yaml"), ["--model.seq_len", "8"]) == {
        ("model", "seq_len"): "8"
    }
    for path in (tmp_path / "bad.yaml", tmp_path / "missing.yaml"):
        try:
            cli.main(["train", "--config_path", str(path)])
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("loomax train: error: ") and "\n" not in err, err
