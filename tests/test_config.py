"""Config loading: !include, overrides, durations, and every error path names key and file."""

from __future__ import annotations

from datetime import timedelta

import pytest

from loomax.config import ConfigError, format_duration, parse_config, parse_duration
from loomax.lm import TrainLmConfig
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import JsonlTrackerConfig, NoopTrackerConfig


def write(path, text):
    path.write_text(text)
    return path


def test_quickstart_parses_with_include(repo_root):
    config = parse_config(TrainLmConfig, repo_root / "config" / "quickstart.yaml")
    assert isinstance(config.model, Gpt2Config)
    assert isinstance(config.optimizer, AdamConfig)
    assert config.data.train[0].embedded == "python_stdlib"  # from config/data/python_stdlib.yaml
    assert config.data.tokenizer_vocab_size == 4096


def test_bench_config_parses(repo_root):
    config = parse_config(TrainLmConfig, repo_root / "config" / "bench" / "gpt2_tiny.yaml")
    assert (config.model.hidden_dim, config.model.num_layers, config.model.num_heads) == (256, 4, 4)
    assert (config.model.seq_len, config.model.vocab_size, config.trainer.train_batch_size) == (
        256,
        50257,
        8,
    )
    assert config.trainer.mp == "f32"


def test_cli_overrides_win_over_file(tmp_path):
    path = write(
        tmp_path / "run.yaml",
        "trainer:\n  num_train_steps: 10\nmodel:\n  type: gpt2\n  hidden_dim: 64\n",
    )
    config = parse_config(
        TrainLmConfig,
        path,
        [
            "--trainer.num_train_steps",
            "50",
            "--model.num_heads",
            "2",
            "--optimizer.learning_rate",
            "0.01",
        ],
    )
    assert config.trainer.num_train_steps == 50
    assert config.model.hidden_dim == 64 and config.model.num_heads == 2
    assert config.optimizer.learning_rate == 0.01


def test_tracker_list_and_choice(tmp_path):
    path = write(
        tmp_path / "run.yaml", "trainer:\n  tracker:\n    - type: jsonl\n    - type: noop\n"
    )
    config = parse_config(TrainLmConfig, path)
    assert [type(t) for t in config.trainer.tracker] == [JsonlTrackerConfig, NoopTrackerConfig]
    config = parse_config(TrainLmConfig, None, ["--trainer.tracker.type", "noop"])
    assert isinstance(config.trainer.tracker, NoopTrackerConfig)


def test_nested_include(tmp_path):
    (tmp_path / "parts").mkdir()
    write(tmp_path / "parts" / "opt.yaml", "type: adam\nlearning_rate: 0.002\n")
    path = write(tmp_path / "run.yaml", "optimizer: !include parts/opt.yaml\n")
    assert parse_config(TrainLmConfig, path).optimizer.learning_rate == 0.002


@pytest.mark.parametrize(
    "text, expected",
    [
        ("15m", 900),
        ("1h", 3600),
        ("1h30m", 5400),
        ("90s", 90),
        ("2d", 172800),
        (120, 120),
        ("0.5h", 1800),
    ],
)
def test_durations(text, expected):
    assert parse_duration(text) == timedelta(seconds=expected)
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)


@pytest.mark.parametrize("bad", ["15 minutes", "m15", "1h foo", "", "-5m"])
def test_bad_duration(bad):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_duration_field_from_yaml_and_bad_value(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer:\n  max_train_time: 4m\n")
    assert parse_config(TrainLmConfig, path).trainer.max_train_time == timedelta(minutes=4)
    path = write(tmp_path / "bad.yaml", "trainer:\n  seed: 1\n  max_train_time: soon\n")
    with pytest.raises(ConfigError, match=r"(?s)trainer\.max_train_time.*soon.*bad\.yaml, line 3"):
        parse_config(TrainLmConfig, path)


def test_unknown_key_names_key_file_and_line(tmp_path):
    path = write(tmp_path / "run.yaml", "model:\n  type: gpt2\n  hiden_dim: 3\n")
    with pytest.raises(ConfigError) as e:
        parse_config(TrainLmConfig, path)
    assert "hiden_dim" in str(e.value) and "`model`" in str(e.value)
    assert "run.yaml, line 3" in str(e.value)


def test_unknown_key_in_included_file_points_there(tmp_path):
    write(tmp_path / "data.yaml", "cache_dir: c\ntrian: []\n")
    path = write(tmp_path / "run.yaml", "trainer:\n  seed: 3\ndata: !include data.yaml\n")
    with pytest.raises(ConfigError) as e:
        parse_config(TrainLmConfig, path)
    assert "trian" in str(e.value) and "data.yaml, line 2" in str(e.value)


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer:\n  num_train_steps: many\n")
    with pytest.raises(ConfigError, match=r"trainer\.num_train_steps.*many.*run\.yaml, line 2"):
        parse_config(TrainLmConfig, path)


def test_wrong_type_on_command_line(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)trainer\.train_batch_size.*lots.*command line"):
        parse_config(TrainLmConfig, None, ["--trainer.train_batch_size", "lots"])


def test_unknown_choice(tmp_path):
    path = write(tmp_path / "run.yaml", "model:\n  type: gpt3\n")
    with pytest.raises(ConfigError, match=r"`model`.*gpt3.*run\.yaml, line 1"):
        parse_config(TrainLmConfig, path)


def test_invalid_value_names_key(tmp_path):
    path = write(tmp_path / "run.yaml", "model:\n  hidden_dim: 100\n  num_heads: 3\n")
    with pytest.raises(
        ConfigError, match=r"model\.hidden_dim \(100\) must be divisible by model\.num_heads \(3\)"
    ):
        parse_config(TrainLmConfig, path)
    with pytest.raises(ConfigError, match=r"trainer\.mp"):
        parse_config(TrainLmConfig, None, ["--trainer.mp", "p=f99"])


def test_a_sections_own_check_names_the_file_and_line_of_its_key(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer:\n  seed: 1\nmodel:\n  hidden_dim: 100\n")
    with pytest.raises(ConfigError) as e:  # num_heads keeps its default (12)
        parse_config(TrainLmConfig, path)
    assert str(e.value) == (
        f"model.hidden_dim (100) must be divisible by model.num_heads (12) ({path}, line 4)"
    )
    with pytest.raises(ConfigError, match=r"model\.num_heads \(3\) \(.*run\.yaml, line 4; "):
        parse_config(
            TrainLmConfig, path, ["--model.num_heads", "3"]
        )  # both keys named, each located


def test_a_sections_own_check_follows_includes_and_names_flags_and_overlays(tmp_path):
    write(tmp_path / "model.yaml", "type: gpt2\nnum_heads: 3\nhidden_dim: 100\n")
    path = write(tmp_path / "run.yaml", "trainer:\n  seed: 1\nmodel: !include model.yaml\n")
    with pytest.raises(ConfigError) as e:
        parse_config(TrainLmConfig, path)
    message = str(e.value)
    assert f"model.hidden_dim: {tmp_path / 'model.yaml'}, line 3" in message
    assert f"model.num_heads: {tmp_path / 'model.yaml'}, line 2" in message

    with pytest.raises(ConfigError) as e:
        parse_config(TrainLmConfig, path, ["--model.hidden_dim", "96", "--trainer.log_every=0"])
    assert str(e.value) == (
        "trainer.log_every must be > 0, got 0 (from the command line flag --trainer.log_every)"
    )

    overlay = write(tmp_path / "plan.yaml", "trainer:\n  mesh:\n    data: 0\n")
    with pytest.raises(ConfigError) as e:
        parse_config(TrainLmConfig, None, ["--overlay", str(overlay)])
    assert str(e.value).endswith(f"got 0 (overlay {overlay}, line 3)")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        parse_config(TrainLmConfig, tmp_path / "nope.yaml")


def test_missing_include_names_file_and_line(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer:\n  seed: 1\ndata: !include data/missing.yaml\n")
    with pytest.raises(
        ConfigError, match=r"run\.yaml, line 3: !include of missing file .*missing\.yaml"
    ):
        parse_config(TrainLmConfig, path)


def test_invalid_yaml(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_config(TrainLmConfig, path)


def cli_exit(args: list[str], capsys) -> tuple[int, str]:
    """`loomax ARGS` run by the CLI's main in this process: its exit code and stderr."""
    from loomax.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(args)
    return exit.value.code, capsys.readouterr().err


def test_cli_unknown_flag_exits_2_before_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli_exit(["train", "--trainer.num_train_step", "5"], capsys)
    assert code == 2
    assert "--trainer.num_train_step 5 (did you mean --trainer.num_train_steps?)" in err
    assert not list(tmp_path.iterdir())  # stopped before any work


def test_cli_bad_value_exits_2_with_message(tmp_path, capsys, monkeypatch):
    path = write(tmp_path / "run.yaml", "model:\n  type: gpt2\n  num_layers: two\n")
    monkeypatch.chdir(tmp_path)
    code, err = cli_exit(["train", "--config_path", str(path)], capsys)
    assert code == 2
    assert "model.num_layers" in err and "run.yaml, line 3" in err
    assert not (tmp_path / "runs").exists()  # stopped before any work


def test_overlay_sets_its_keys_where_it_stands_and_later_flags_win(tmp_path, repo_root):
    overlay = tmp_path / "plan.yaml"
    overlay.write_text(
        "trainer:\n"
        "  mesh: {replica: 1, data: 1, model: 1}\n"
        "  tensor_parallel_axes: [heads]\n"  # a list: one JSON flag
        "  num_train_steps: 7\n"
        "  axis_resources: {batch: data}\n"  # a mapping-valued field: one flag\n
        "model:\n"
        "  gradient_checkpointing: false\n"  # a choice section: keys left to draccus
    )
    run = str(repo_root / "config" / "llama_tiny.yaml")
    before = parse_config(TrainLmConfig, run, ["--trainer.num_train_steps", "3"])
    config = parse_config(
        TrainLmConfig,
        run,
        ["--trainer.num_train_steps", "3", "--overlay", str(overlay), "--trainer.seed", "5"],
    )
    assert config.trainer.num_train_steps == 7  # the overlay came after the flag
    assert config.trainer.seed == 5
    assert config.trainer.tensor_parallel_axes == ["heads"] != before.trainer.tensor_parallel_axes
    assert config.trainer.axis_resources == {"batch": "data"}
    assert config.model.gradient_checkpointing is False
    last = parse_config(
        TrainLmConfig, run, [f"--overlay={overlay}", "--trainer.num_train_steps", "2"]
    )
    assert last.trainer.num_train_steps == 2


def test_overlay_unknown_key_names_file_and_line(tmp_path):
    overlay = tmp_path / "bad.yaml"
    overlay.write_text("trainer:\n  seed: 1\n  mesh:\n    dat: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"bad.yaml, line 4: `trainer.mesh.dat` is not a config key \(did you mean "
        r"`trainer.mesh.data`\?\) \(keys of trainer.mesh:",
    ):
        parse_config(TrainLmConfig, None, ["--overlay", str(overlay)])
    with pytest.raises(ConfigError, match="overlay file not found"):
        parse_config(TrainLmConfig, None, ["--overlay", str(tmp_path / "missing.yaml")])
