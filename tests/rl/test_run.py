"""``loomax rl`` on the shipped config (shrunk): rollout and loss metrics are logged, held-out
exact match is scored, and a run resumed from a mid-run checkpoint repeats the first run's
rewards and losses bitwise: at a rollout boundary (the rollout's keys and prompts follow from
the state's step) and inside a rollout (the checkpoint holds its batch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loomax.cli import main

CONFIG = Path(__file__).parents[2] / "config" / "rl_tiny.yaml"
SMALL = ["--model.hidden_dim", "32", "--model.intermediate_dim", "64", "--model.num_heads", "2",
         "--model.num_kv_heads", "1", "--trainer.train_batch_size", "16", "--rl.group_size", "4",
         "--rl.minibatches", "2", "--rl.warm_start_steps", "15", "--rl.max_eval_prompts", "16",
         "--rl.max_new_tokens", "8", "--trainer.num_train_steps", "4",
         "--trainer.steps_per_eval", "100", "--trainer.log_every", "1",
         "--trainer.progress_bar", "false",
         "--trainer.checkpointer.fixed_steps", "[2, 3]", "--rl.kl_beta", "0.05",
         "--rl.rewards", "{exact_match: 1.0, format: 0.5}"]  # fmt: skip


def _records(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update(record)
    return out


@pytest.mark.slow  # ~15 s: a warm start, 4 RL steps (2 rollouts), then resumed twice
def test_rl_logs_its_metrics_and_a_resumed_run_repeats_rewards_and_losses(tmp_path, capsys):
    run = tmp_path / "run"
    main(["rl", "--config_path", str(CONFIG), "--trainer.run_dir", str(run), *SMALL])
    out = capsys.readouterr().out
    assert "held-out exact match: step 0:" in out and "steps: 4 of 4" in out
    first = _records(run)
    for key in ("rl/reward_mean", "rl/reward_std", "rl/response_length", "rollout/tokens_per_s",
                "rl/kl", "rl/clip_fraction", "rl/entropy", "train/loss"):  # fmt: skip
        assert key in first[3], key
    assert "rl/reward_mean" not in first[2]  # steps 1-2 train on rollout 0, steps 3-4 on rollout 1
    assert first[3]["rl/reward_std"] > 0 and first[3]["optim/grad_norm"] > 0  # a signal
    assert first[4]["rl/kl"] > 0  # the policy moved away from the reference
    assert "eval/rl/exact_match" in first[0] and "eval/rl/exact_match" in first[4]
    shutil.rmtree(run / "checkpoints" / "step-4")  # resume inside rollout 1: its saved batch
    assert (run / "checkpoints" / "step-3" / "rl_rollout.npz").is_file()
    assert not (run / "checkpoints" / "step-2" / "rl_rollout.npz").exists()
    main(["rl", "--config_path", str(CONFIG), "--trainer.run_dir", str(run), *SMALL])
    _same(first, _records(run), [4])
    shutil.rmtree(run / "checkpoints" / "step-4")
    shutil.rmtree(run / "checkpoints" / "step-3")  # resume at the boundary: rollout 1 sampled again
    main(["rl", "--config_path", str(CONFIG), "--trainer.run_dir", str(run), *SMALL])
    _same(first, _records(run), [3, 4])


def _same(first: dict, again: dict, steps: list[int]) -> None:
    for step in steps:
        for key in ("rl/reward_mean", "rl/reward_std", "train/loss", "rl/kl", "optim/grad_norm"):
            if key in first[step]:
                assert again[step][key] == first[step][key], (step, key)
