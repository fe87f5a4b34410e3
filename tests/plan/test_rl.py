"""``loomax compile`` of a ``loomax rl`` run: its YAML recognised, the rollout and the GRPO update
compiled in the compile child, memory per device for each (rl_tiny here, as shipped; the other
shipped RL configs shrunk in tests/plan/test_shipped_configs.py)."""

from __future__ import annotations

import json

import pytest

from loomax.cli import main
from loomax.config import ConfigError
from loomax.plan.rl import is_rl_config, rl_vocab_size
from loomax.rl.command import rl_config


def test_an_rl_run_is_told_by_its_rl_section(repo_root, tmp_path):
    assert is_rl_config(str(repo_root / "config" / "rl_tiny.yaml"))
    assert is_rl_config(str(repo_root / "config" / "rl_1b.yaml"))
    assert not is_rl_config(str(repo_root / "config" / "llama_1b.yaml"))  # has an !include
    assert not is_rl_config(str(repo_root / "config" / "dpo_tiny.yaml"))
    assert not is_rl_config(None) and not is_rl_config(str(tmp_path / "missing.yaml"))


def test_the_vocabulary_is_the_trained_bpe_or_asked_for(repo_root):
    path = str(repo_root / "config" / "rl_tiny.yaml")
    assert rl_vocab_size(rl_config(path, [])) == 300  # rl.tokenizer_vocab_size
    with pytest.raises(ConfigError, match="pass --model.vocab_size N"):
        rl_vocab_size(rl_config(path, ["--rl.tokenizer", "some/tokenizer.json"]))


def test_plan_refuses_an_rl_run_and_points_to_compile(repo_root, capsys):
    path = str(repo_root / "config" / "rl_tiny.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config_path", path, "--topology", "v5p:2x2x1"])
    assert exit_info.value.code == 2
    assert "`loomax compile` compiles its rollout and update" in capsys.readouterr().err


@pytest.mark.usefixtures("libtpu")
def test_compile_reports_the_rollout_and_the_update(repo_root, tmp_path, capsys, monkeypatch):
    """The command line's path: the config told apart, both programs compiled in the child."""
    # the child at libtpu's quick effort (conftest.py's quick_compiles): the checks read
    # fits, the mesh and nonzero sizes, not the optimized program
    monkeypatch.setenv("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1")
    out = tmp_path / "report.json"
    with_ref = ["--rl.kl_beta", "0.1"]  # as shipped, with a reference: its log-probs in the batch
    path = str(repo_root / "config" / "rl_tiny.yaml")
    main(
        ["compile", "--config_path", path, "--topology", "v5p:2x2x1", "--out", str(out), *with_ref]
    )
    text = capsys.readouterr().out
    assert "rollout: " in text and "update: " in text and "DOES NOT FIT" not in text
    assert "16 prompts × 8 samples" in text and "old and reference log-probs" in text
    report = json.loads(out.read_text())
    for program in ("rollout", "update"):
        assert report[program]["fits"] is True
        assert report[program]["total_bytes"] > report[program]["temp_bytes"] > 0
        assert report[program]["mesh"]["data"] == 4


def test_the_1b_record_agrees_with_the_docs(repo_root):
    """docs/post_training.md's v5p:2x2x2 figures for config/rl_1b.yaml are its results file's."""
    name = "compile_rl_1b_v5p-2x2x2_2026-11-29.json"
    record = json.loads((repo_root / "bench" / "results" / name).read_text())
    docs = (repo_root / "docs" / "post_training.md").read_text()
    assert name in docs
    for program in ("rollout", "update"):
        r = record[program]
        assert r["fits"] is True and r["topology"] == "v5p:2x2x2" and r["mesh"]["data"] == 8
        assert f"{program}: {r['total_bytes'] / 2**30:.3f} GiB per device" in docs
        assert f"state {r['state_bytes'] / 2**30:.3f} GiB" in docs
        assert f"temporaries {r['temp_bytes'] / 2**30:.3f} GiB" in docs
