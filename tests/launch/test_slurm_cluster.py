"""``loomax launch --target slurm`` on a real one-node SLURM cluster.

``infra/slurm/single_node.sh`` installs SLURM (apt-get) and starts munged, slurmctld and
slurmd when they are not running (3-8 s here: 7.7 s downloading from the Debian mirror,
3.4 s with the packages in apt's cache, 0.1 s when already up; the daemons stay up
after). The launcher submits with the real ``sbatch``, the job trains 2 tasks on CPU
devices (JAX's SLURM auto-detection joins them), and ``squeue``, ``scontrol`` and
``sacct -c`` (the job-completion log: there is no slurmdbd) report it done. Skipped, with
the reason, where SLURM cannot be installed: not root, no apt-get, no package mirror.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "slurm" / "single_node.sh"
LOOMAX_BIN = Path(sys.executable).parent / "loomax"
CANNOT_INSTALL = 3  # single_node.sh's exit code when apt-get cannot install SLURM


@pytest.fixture(scope="module")
def slurm_cluster() -> float:
    """A running one-node cluster; the seconds its install and start took."""
    if os.geteuid() != 0:
        pytest.skip(
            "a SLURM cluster needs root (infra/slurm/single_node.sh installs and starts it)"
        )
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("no SLURM and no apt-get to install it (Debian/Ubuntu only)")
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900)
    if result.returncode == CANNOT_INSTALL:
        pytest.skip(f"SLURM cannot be installed here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return time.monotonic() - start


def slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_a_launched_job_trains_two_tasks_and_slurm_reports_it_done(
    tmp_path, data_args, launch_env, slurm_cluster
):
    print(f"SLURM install + start: {slurm_cluster:.1f} s")
    if not LOOMAX_BIN.exists():
        pytest.skip(f"no loomax executable next to {sys.executable}")
    run_dir, steps = tmp_path / "run", 10
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
    }
    argv = [
        sys.executable, "-m", "loomax.cli", "launch", "--target", "slurm",
        "--processes_per_host", "2", "--gpus_per_node", "0", "--time_limit", "00:15:00",
        "--job_name", "loomax-test", "--remote_dir", str(REPO), "--loomax_bin", str(LOOMAX_BIN),
        "--env", json.dumps(env),
        "--", "train", "--config_path", str(REPO / "config" / "quickstart.yaml"), *data_args,
        "--trainer.num_train_steps", str(steps),
        "--trainer.log_every", "1",
        "--trainer.steps_per_eval", "1000",
        "--trainer.eval_at_start", "false",
        "--trainer.tracker", '[{"type": "jsonl"}]',
        "--trainer.run_dir", str(run_dir),
    ]  # fmt: skip
    submit = subprocess.run(argv, env=launch_env, cwd=tmp_path, capture_output=True, text=True)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job = re.search(r"Submitted batch job (\d+)", submit.stdout).group(1)

    deadline = time.monotonic() + 600
    while slurm("squeue", "-h", "-j", job).strip():  # queued or running
        assert time.monotonic() < deadline, slurm("scontrol", "show", "job", job)
        time.sleep(0.5)
    out = tmp_path / f"loomax-test-{job}.out"
    log = out.read_text() if out.exists() else "(no job output)"
    assert "JobState=COMPLETED" in slurm("scontrol", "show", "job", job), log[-4000:]
    assert f"{job}|COMPLETED|0:0" in slurm(
        "sacct", "-c", "-j", job, "-n", "-P", "-o", "JobID,State,ExitCode"
    )

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # once each: process 0 alone
    final = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "metadata.json").read_text())
    assert final["process_count"] == 2  # the two tasks trained as one job
