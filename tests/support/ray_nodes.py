"""Ray nodes the tests start with `ray start --block`, each in a process group of its own.

`start_node` returns once the node says it is up, `stop_node` ends its whole group. The
test run's shared cluster (`shared_head`, the `ray_cluster` fixture's) is one head that
every xdist worker of the run joins: a Ray start costs ~10-25 CPU-seconds of daemons and
their workers, and ~15 s before it answers, so one per run instead of one per worker and
per run of Ray modules. The controller stops it at the end (`stop_shared_head`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))

PORT_TAKEN = re.compile(r"already in use|address in use|EADDRINUSE|failed to add port", re.I)
"""How `ray start --head` says that its port was taken (picked by binding port 0, then freed)."""

SHARED_HEAD = "shared-ray-head.json"
"""The shared head's record (address, process group, temp dir) in the run's directory."""


class NodeStartFailed(AssertionError):
    """`ray start` exited or timed out; the message ends with its log."""


def start_node(args: list[str], temp_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    """`ray start --block ARGS` in a process group of its own, once the node is up."""
    temp_dir.mkdir(parents=True)
    log = open(temp_dir / "ray_start.log", "w+")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while "Ray runtime started" not in (temp_dir / "ray_start.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_node(proc)
            log = (temp_dir / "ray_start.log").read_text()
            raise NodeStartFailed(f"ray start {args}: {log[-2000:]}")
        time.sleep(0.2)
    return proc


def stop_node(node: subprocess.Popen | int) -> None:
    """SIGKILL to the process group of a node (its raylet, GCS, agents and workers): a
    `start_node` process, or the pid of one another process started (the shared head,
    stopped by the controller). These nodes keep everything in temp dirs of the tests' own,
    removed afterwards, so nothing needs Ray's own shutdown on SIGTERM, which takes ~30 s
    here (it used to cost 5 s of waiting per node before the SIGKILL)."""
    pid = node if isinstance(node, int) else node.pid
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if isinstance(node, subprocess.Popen):
        node.wait(timeout=30)
        return
    deadline = time.monotonic() + 30  # not our child: another process reaps it
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def start_head(
    root: Path,
    env: dict[str, str],
    free_port: Callable[[], int],
    *,
    cpus: int,
    extra: Sequence[str] = (),
) -> tuple[subprocess.Popen, int]:
    """A head node on 127.0.0.1 with `cpus` CPUs and its temp dir under `root`; (process,
    port). Tried once more if its port (picked by `free_port`) was taken before it bound it."""
    for attempt in range(2):
        port = free_port()
        args = ["--head", f"--port={port}", "--include-dashboard=false", f"--num-cpus={cpus}"]
        args += [f"--temp-dir={root}/h{attempt}", "--node-ip-address=127.0.0.1", *extra]
        try:
            return start_node(args, root / f"head{attempt}", env), port
        except NodeStartFailed as error:
            if attempt == 1 or not PORT_TAKEN.search(str(error)):
                raise
    raise AssertionError("unreachable")


def shared_head(run_dir: Path, free_port: Callable[[], int]) -> str:
    """The address of the run's shared 2-CPU Ray head, started by the first caller.

    Token authentication is off on it (it listens on 127.0.0.1 only), so drivers and
    subprocesses join it with the address alone; its temp dir (and so its
    `ray_current_cluster` record) is its own, so tests that look for a machine-wide Ray
    do not find it.
    """
    with open(run_dir / "shared-ray-head.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = run_dir / SHARED_HEAD
        if record.exists():
            return json.loads(record.read_text())["address"]
        root = Path(tempfile.mkdtemp(prefix="lxshr", dir="/tmp"))  # Ray's socket paths: short
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.pop("RAY_ADDRESS", None)
        env |= {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(root)}
        # no log monitor: drivers here read no worker logs (log_to_driver=False), and over a
        # whole run it would cost ~25 CPU-seconds polling the workers' log files
        try:
            proc, port = start_head(
                root, env, free_port, cpus=2, extra=["--include-log-monitor=false"]
            )
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # no record: nobody else would remove it
            raise
        address = f"127.0.0.1:{port}"
        record.write_text(json.dumps({"address": address, "pid": proc.pid, "root": str(root)}))
        return address


def stop_shared_head(run_dir: Path) -> None:
    """Stop the run's shared head, if one was started, and remove its temp dir."""
    record = run_dir / SHARED_HEAD
    if not record.exists():
        return
    info = json.loads(record.read_text())
    stop_node(info["pid"])
    shutil.rmtree(info["root"], ignore_errors=True)
    record.unlink()
