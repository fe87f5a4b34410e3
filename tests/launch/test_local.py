"""``loomax launch --target local``: real training on 2 processes, a preempted attempt retried.

The test starts the real CLI in subprocesses (the point is real processes and the same
jax.distributed path as a pod), on the launch tests' shared data cache (``data_args`` in
conftest.py, built once per session).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def launch(tmp_path, env, launch_options, train_args, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "loomax.cli", "launch", "--target", "local", *launch_options]
    argv += ["--", "train", "--config_path", str(REPO / "config" / "quickstart.yaml"), *train_args]
    return subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)


def worker_pids(launcher: int) -> list[int]:
    """The launcher's child processes (the training processes), oldest first."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return sorted(int(pid) for pid in children)


def test_two_processes_train_a_preempted_attempt_relaunches_and_process_0_alone_logs(
    tmp_path, data_args, launch_env
):
    """One launch of 2 processes: a worker is killed after the step-5 checkpoint, the
    launcher relaunches both, the run resumes and finishes; process 0 alone writes the
    metrics and the wandb run. (One scenario: each launch costs two JAX processes.)"""
    run_dir = tmp_path / "run"
    steps = 20
    trackers = json.dumps([{"type": "jsonl"}, {"type": "wandb", "project": "launch-test"}])
    train = [
        *data_args,
        "--trainer.num_train_steps", str(steps),
        "--trainer.log_every", "5",
        "--trainer.steps_per_eval", str(steps),
        "--trainer.checkpointer.keep", '[{"every": 5}]',
        "--trainer.run_dir", str(run_dir),
        "--trainer.tracker", trackers,
    ]  # fmt: skip
    with open(tmp_path / "launch.log", "w") as log:
        proc = launch(tmp_path, launch_env, ["--num_processes", "2", "--retries", "1"], train, log)
        first = run_dir / "checkpoints" / "step-5" / "metadata.json"
        deadline = time.monotonic() + 400
        while not first.exists():
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint at step 5"
            time.sleep(0.05)
        victim = worker_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)  # preemption: a process dies without warning
        code = proc.wait(timeout=600)
    output = (tmp_path / "launch.log").read_text()
    assert code == 0, output[-4000:]  # the launcher exits 0 only if both processes did
    assert "attempt 1 of 2 failed (exit -9): relaunching" in output
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    assert resumed, output[-4000:]
    step = int(resumed[0].rsplit("(step ", 1)[1].rstrip(")"))
    assert 5 <= step < steps
    final = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "metadata.json").read_text())
    assert final["process_count"] == 2

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records]
    # process 0 alone logs, each step once: the relaunched attempt's records replace what
    # the preempted one logged after its checkpoint
    assert logged == sorted(set(logged)) and logged[0] == 0 and step in logged
    assert "eval/loss" in records[logged.index(step)]
    assert logged[-1] == steps and "eval/loss" in records[-1] and "train/loss" in records[-1]
    wandb_runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2, wandb_runs  # one per attempt, from process 0
