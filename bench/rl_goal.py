"""The RL goal: a warm-started tiny Llama, then GRPO, on the shipped sorting task.

    python bench/rl_goal.py OUT.json [--flag value ...]   # flags go to `loomax rl`

Runs `loomax rl --config_path config/rl_tiny.yaml` in this process (a fresh run dir under
/tmp), then prints and writes: held-out exact match (greedy, 200 prompts) after the warm
start and after GRPO, the best in between, the RL wall time (first RL step to the last,
from the trainer's own clock), the process's CPU seconds (getrusage: warm start + RL +
evaluations), and the rollout throughput the run logged. Wall figures depend on the load.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from loomax.cli import main as loomax

REPO = Path(__file__).resolve().parents[1]


def summarise(run: Path) -> dict:
    """The run's held-out scores, rollout throughput and reward curve from metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/rl/exact_match"]) for r in records if "eval/rl/exact_match" in r]
    rollouts = [r for r in records if "rollout/tokens_per_s" in r]
    return {
        "held_out_exact_match": evals,
        "before": evals[0][1],
        "after": evals[-1][1],
        "gain_points": round(100 * (evals[-1][1] - evals[0][1]), 1),
        "rollout_tokens_per_s_median": sorted(r["rollout/tokens_per_s"] for r in rollouts)[
            len(rollouts) // 2
        ],
        "train_reward_mean": [(r["step"], round(r["rl/reward_mean"], 3)) for r in rollouts],
    }


def main(out: str, flags: list[str]) -> None:
    run = Path(tempfile.mkdtemp(prefix="rl_goal_")) / "run"
    args = ["rl", "--config_path", str(REPO / "config/rl_tiny.yaml"), "--trainer.run_dir", str(run),
            "--trainer.progress_bar", "false", *flags]  # fmt: skip
    started = time.perf_counter()
    loomax(args)
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "command": "loomax " + " ".join(args),
        "machine": f"AMD EPYC, {os.cpu_count()} cores, shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end)",
        "wall_s_total": round(wall, 1),
        "cpu_s_total": round(usage.ru_utime + usage.ru_stime, 1),
        **summarise(run),
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "train_reward_mean"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
