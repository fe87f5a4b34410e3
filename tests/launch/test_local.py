"""``loomax launch --target local``: real training on 2 processes, and a preempted launch retried.

Both tests start the real CLI in subprocesses (the point is real processes and the same
jax.distributed path as a pod); they share one data cache
(``data_args`` in conftest.py) so Ray builds it only once.
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


def test_two_processes_train_and_process_0_writes_the_metrics(tmp_path, data_args, launch_env):
    run_dir = tmp_path / "run"
    trackers = json.dumps([{"type": "jsonl"}, {"type": "wandb", "project": "launch-test"}])
    train = [
        *data_args,
        "--trainer.num_train_steps", "5",
        "--trainer.log_every", "1",
        "--trainer.steps_per_eval", "5",
        "--trainer.run_dir", str(run_dir),
        "--trainer.tracker", trackers,
    ]  # fmt: skip
    with open(tmp_path / "launch.log", "w") as log:
        proc = launch(tmp_path, launch_env, ["--num_processes", "2"], train, log)
        code = proc.wait(timeout=600)
    output = (tmp_path / "launch.log").read_text()
    assert code == 0, output[-4000:]  # the launcher exits 0 only if both processes did

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]  # once each: process 0 alone logs
    assert all("train/loss" in r for r in records[1:]) and "eval/loss" in records[-1]
    meta = json.loads((run_dir / "checkpoints" / "step-5" / "metadata.json").read_text())
    assert meta["process_count"] == 2
    wandb_runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1  # one wandb run, from process 0


def worker_pids(launcher: int) -> list[int]:
    """The launcher's child processes (the training processes), oldest first."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return sorted(int(pid) for pid in children)


def test_a_preempted_launch_relaunches_and_resumes_from_the_last_checkpoint(
    tmp_path, data_args, launch_env
):
    run_dir = tmp_path / "run"
    steps = 40
    train = [
        *data_args,
        "--trainer.num_train_steps", str(steps),
        "--trainer.log_every", "5",
        "--trainer.steps_per_eval", "1000",
        "--trainer.eval_at_start", "false",
        "--trainer.checkpointer.keep", '[{"every": 5}]',
        "--trainer.run_dir", str(run_dir),
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
    assert code == 0, output[-4000:]
    assert "attempt 1 of 2 failed (exit -9): relaunching" in output
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    assert resumed, output[-4000:]
    step = int(resumed[0].rsplit("(step ", 1)[1].rstrip(")"))
    assert 5 <= step < steps
    final = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "metadata.json").read_text())
    assert final["process_count"] == 2
