"""The wandb tracker, run for real offline; its run files are read back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from loomax.errors import UserError
from loomax.tracking import (
    JsonlTrackerConfig,
    MissingPackageError,
    WandbCredentialsError,
    WandbTrackerConfig,
    build_tracker,
    check_trackers,
)

from .conftest import offline_runs, read_wandb_run


def git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def dirty_repo(tmp_path, monkeypatch):
    """A git repository with one commit and an uncommitted change; the working directory."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("steps = 1\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "first")
    (repo / "train.py").write_text("steps = 2\n")
    monkeypatch.chdir(repo)
    monkeypatch.delenv("LOOMAX_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return head.stdout.strip()


def test_metrics_config_summary_and_git_reach_the_run_files(wandb_offline, dirty_repo, tmp_path):
    config = WandbTrackerConfig(
        project="proj", tags=["a", "b"], group="g", notes="hello", name="first"
    )
    tracker = build_tracker(config, tmp_path / "run")
    tracker.log_hyperparameters({"trainer.seed": 3, "model.hidden_dim": 32})
    tracker.log({"train/loss": np.float32(2.5), "optim/learning_rate": 1e-3}, step=10)
    tracker.log({"train/loss": 2.0}, step=20)
    tracker.log_summary({"eval/loss": 1.75})
    tracker.finish()

    (run_files,) = offline_runs(wandb_offline)
    run = read_wandb_run(run_files)
    assert run["id"] == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert (run["project"], run["tags"], run["group"], run["notes"]) == (
        "proj",
        ["a", "b"],
        "g",
        "hello",
    )
    assert run["config"]["trainer"] == {"seed": 3}
    assert run["config"]["model"] == {"hidden_dim": 32}
    assert run["config"]["git"] == {"commit": dirty_repo, "dirty": True, "remote": None}
    rows = [(r["_step"], r["train/loss"]) for r in run["history"]]
    assert rows == [(10, 2.5), (20, 2.0)]
    assert run["history"][0]["optim/learning_rate"] == pytest.approx(1e-3)
    assert run["summary"]["eval/loss"] == 1.75
    assert "git_diff.patch" in run["files"]
    patch = (run_files / "files" / "git_diff.patch").read_text()
    assert "-steps = 1" in patch and "+steps = 2" in patch


def test_resuming_in_the_same_run_dir_continues_the_same_wandb_run(wandb_offline, tmp_path):
    run_dir = tmp_path / "run"
    for step in (5, 10):  # the job, then the job resumed from its checkpoint
        tracker = WandbTrackerConfig().init(run_dir)
        tracker.log({"train/loss": float(step)}, step=step)
        tracker.finish()
    first, second = (read_wandb_run(p) for p in offline_runs(wandb_offline))
    assert first["id"] == second["id"]
    assert [r["_step"] for r in first["history"] + second["history"]] == [5, 10]


def test_configured_id_wins_and_is_stored(wandb_offline, tmp_path):
    tracker = WandbTrackerConfig(id="fixed123").init(tmp_path / "run")
    tracker.finish()
    assert read_wandb_run(offline_runs(wandb_offline)[0])["id"] == "fixed123"
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == "fixed123"


def test_artifacts_are_logged(wandb_offline, tmp_path):
    tracker = WandbTrackerConfig().init(tmp_path / "run")
    path = tmp_path / "run" / "notes.json"
    path.write_text('{"lr": 0.1}')
    tracker.log_artifact(path, name="notes.json", type="notes")
    tracker.finish()
    run = read_wandb_run(offline_runs(wandb_offline)[0])
    (artifact,) = run["artifacts"]
    assert (artifact["name"], artifact["type"], artifact["run_id"]) == (
        "notes.json",
        "notes",
        run["id"],
    )
    assert {name: size for name, (size, _) in artifact["files"].items()} == {"notes.json": 11}


def test_bad_mode_names_the_key():
    with pytest.raises(ValueError, match="trainer.tracker.mode must be one of"):
        WandbTrackerConfig(mode="sometimes")


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(MissingPackageError, match=r"pip install 'loomax\[wandb\]'"):
        WandbTrackerConfig().init(tmp_path)
    with pytest.raises(MissingPackageError, match=r"pip install 'loomax\[wandb\]'"):
        check_trackers(WandbTrackerConfig())  # up front, before a run builds anything


def test_the_real_run_config_logs_to_wandb_and_jsonl(repo_root):
    from loomax.config import parse_config
    from loomax.lm import TrainLmConfig
    from loomax.tracking import JsonlTrackerConfig

    config = parse_config(TrainLmConfig, repo_root / "config" / "gpt2_small.yaml")
    wandb, jsonl = config.trainer.tracker
    assert isinstance(wandb, WandbTrackerConfig) and isinstance(jsonl, JsonlTrackerConfig)
    assert (wandb.project, wandb.tags) == ("loomax", ["gpt2", "small", "openwebtext"])


def test_online_without_an_api_key_says_what_to_set(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(
        ValueError, match="set WANDB_API_KEY or run `wandb login`, or use mode: offline"
    ):
        WandbTrackerConfig(mode="online").init(tmp_path / "run")


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No WANDB_API_KEY, no netrc, no wandb settings, fresh wandb settings; no network."""
    from wandb.sdk import wandb_setup

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setattr(wandb_setup, "_singleton", None)  # settings read from this env

    def no_network(*args, **kwargs):
        raise AssertionError("the credentials check contacted a server")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)


def test_online_without_credentials_stops_before_any_work(no_credentials, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(WandbCredentialsError) as error:
        check_trackers([JsonlTrackerConfig(), WandbTrackerConfig(dir=str(run_dir))])
    message = str(error.value)
    assert message.startswith("trainer.tracker type: wandb logs online (mode online)")
    for fix in ("set WANDB_API_KEY", "run `wandb login`", "use mode: offline"):
        assert fix in message
    assert isinstance(error.value, UserError)  # one line from the CLI, exit code 2
    assert not run_dir.exists()
    with pytest.raises(WandbCredentialsError, match="finds no API key"):
        check_trackers(WandbTrackerConfig(mode="online"))


def test_credentials_wandb_finds_pass_the_check(no_credentials, monkeypatch, tmp_path):
    key = "k" * 40
    monkeypatch.setenv("WANDB_API_KEY", key)
    check_trackers(WandbTrackerConfig())
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
    check_trackers(WandbTrackerConfig())  # as `wandb login` leaves it


def test_a_malformed_key_is_named(no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(WandbCredentialsError, match="WANDB_API_KEY invalid"):
        check_trackers(WandbTrackerConfig())


def test_offline_and_disabled_need_no_credentials(no_credentials, monkeypatch):
    check_trackers(WandbTrackerConfig(mode="offline"))
    check_trackers(WandbTrackerConfig(mode="disabled"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(WandbTrackerConfig())


def test_loomax_train_stops_before_the_data_without_credentials(tmp_path, tiny_corpus):
    """``loomax train`` ends with one line and exit code 2, before the data is tokenized."""
    config = {
        "data": {"train": [{"urls": [str(tiny_corpus)]}], "cache_dir": str(tmp_path / "cache")},
        "model": {"seq_len": 32, "hidden_dim": 64, "num_layers": 2, "num_heads": 2},
        "trainer": {
            "num_train_steps": 2,
            "train_batch_size": 8,
            "run_dir": str(tmp_path / "run"),
            "tracker": {"type": "wandb", "mode": "online"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(tmp_path),
        NETRC=str(tmp_path / "netrc"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "loomax.cli", "train", "--config_path", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loomax train: error: trainer.tracker type: wandb logs online"), last
    assert "set WANDB_API_KEY or run `wandb login`, or use mode: offline" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists()  # stopped before the data was even tokenized
