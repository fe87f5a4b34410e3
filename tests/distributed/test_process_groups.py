"""Stopping a process stops what it started in its group, gently first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from loomax.distributed.process_groups import stop_groups

# A parent that starts a child in its own process group, prints the child's pid, and waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}])
print(child.pid, flush=True)
time.sleep(60)
"""


def start(child: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(child=child)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, int(proc.stdout.readline())


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_sigterm_stops_the_group_within_the_grace():
    proc, child = start("import time; time.sleep(60)")
    stop_groups([proc], grace=5.0)
    assert proc.returncode == -15 and wait_gone(child)  # SIGTERM sufficed


def test_a_helper_that_ignores_sigterm_gets_sigkill():
    proc, child = start(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    )
    stop_groups([proc], grace=0.5)
    assert proc.returncode is not None and wait_gone(child)
