"""``loomax launch --target gpu`` for real: two host entries, a real SSH server, the system ssh.

The server (``ssh_server.py``, asyncssh) listens on 127.0.0.1 and runs every command it
receives in a shell, as sshd does; both host entries point at it, so the two JAX
processes (on CPU devices, gloo collectives) run on this machine but are started,
relaunched and stopped only through ``ssh``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomax.distributed.net import free_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOOMAX_BIN = Path(sys.executable).parent / "loomax"


@pytest.fixture(scope="module")
def ssh_server(tmp_path_factory, require_extra):
    """(port, directory with client_key and commands.log) of a running SSH server."""
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client on PATH")
    require_extra("asyncssh", "the test SSH server")
    directory = tmp_path_factory.mktemp("sshd")
    server = subprocess.Popen(
        [sys.executable, str(HERE / "ssh_server.py"), str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(server.stdout.readline())
        yield port, directory
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def read_pid(process_id: int) -> int | None:
    try:
        return int(Path(f"/tmp/loomax-launch-{process_id}.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_two_hosts_over_ssh_train_and_a_killed_worker_is_relaunched(
    tmp_path, data_args, launch_env, ssh_server
):
    if not LOOMAX_BIN.exists():
        pytest.skip(f"no loomax executable next to {sys.executable}")
    port, server_dir = ssh_server
    for process_id in (0, 1):
        Path(f"/tmp/loomax-launch-{process_id}.pid").unlink(missing_ok=True)
    run_dir, steps = tmp_path / "run", 20
    ssh_options = "[-o, StrictHostKeyChecking=no, -o, UserKnownHostsFile=/dev/null, -o, BatchMode=yes, -o, LogLevel=ERROR]"  # fmt: skip
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
    }
    argv = [
        sys.executable, "-m", "loomax.cli", "launch", "--target", "gpu",
        "--hosts", "[127.0.0.1, 127.0.0.1]", "--ssh_port", str(port),
        "--ssh_identity", str(server_dir / "client_key"), "--ssh_options", ssh_options,
        "--coordinator_port", str(free_port("")), "--remote_dir", str(REPO),
        "--loomax_bin", str(LOOMAX_BIN), "--env", json.dumps(env), "--retries", "1",
        "--", "train", "--config_path", str(REPO / "config" / "quickstart.yaml"), *data_args,
        "--trainer.num_train_steps", str(steps),
        "--trainer.log_every", "5",
        "--trainer.steps_per_eval", "1000",
        "--trainer.eval_at_start", "false",
        "--trainer.checkpointer.keep", '[{"every": 5}]',
        "--trainer.tracker", '[{"type": "jsonl"}]',
        "--trainer.run_dir", str(run_dir),
    ]  # fmt: skip
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen(
            argv, env=launch_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
        )
        first = run_dir / "checkpoints" / "step-5" / "metadata.json"
        deadline = time.monotonic() + 400
        while not first.exists():
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint at step 5"
            time.sleep(0.05)
        first_leader, victim = read_pid(0), read_pid(1)
        assert victim and b"loomax" in Path(f"/proc/{victim}/cmdline").read_bytes()
        os.kill(victim, signal.SIGKILL)  # a worker dies without warning
        code = proc.wait(timeout=600)
    output = (tmp_path / "launch.log").read_text()
    assert code == 0, output[-4000:]
    assert "attempt 1 of 2 failed" in output and "relaunching" in output
    assert first_leader and not alive(first_leader)  # stopped when its ssh client was

    commands = (server_dir / "commands.log").read_text().splitlines()
    ids = [c.split("LOOMAX_PROCESS_ID=", 1)[1].split()[0] for c in commands[-4:]]
    assert sorted(ids[:2]) == sorted(ids[2:]) == ["0", "1"]  # 2 per attempt, all through ssh
    assert all("LOOMAX_NUM_PROCESSES=2" in c and "JAX_PLATFORMS=cpu" in c for c in commands)

    resumed = [line for line in output.splitlines() if "resumed from" in line]
    assert resumed, output[-4000:]
    assert 5 <= int(resumed[0].rsplit("(step ", 1)[1].rstrip(")")) < steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == steps and "train/loss" in records[-1]
    assert all(a["step"] != b["step"] for a, b in itertools.pairwise(records))  # process 0 alone
    final = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "metadata.json").read_text())
    assert final["process_count"] == 2
