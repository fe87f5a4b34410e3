"""Stopping child processes together with everything they started.

Children started with ``start_new_session=True`` lead a process group of their own, which
also holds the helpers they spawn (a Ray node's raylet and GCS, a local Ray of a training
process). Used by ``loomax launch`` for the processes of a job and by the pod's Ray here
for ``ray start``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to ``proc``'s process group; False if the group is gone (or not ours)."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_groups(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """Stop each process and its process group: SIGTERM, then SIGKILL after ``grace`` seconds.

    SIGTERM goes to every group (also of processes that already exited but left helpers
    behind); the processes get up to ``grace`` seconds to exit and their groups to empty;
    then whatever is left of the groups gets SIGKILL. The processes are reaped.
    """
    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and any(signal_group(p, 0) for p in procs):
        time.sleep(0.1)  # helpers still shutting down on their own
    for p in procs:
        signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
