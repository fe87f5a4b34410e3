"""Running a group of processes that stand or fall together, and retrying the group."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from loomax.distributed.process_groups import stop_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    """One process to start: its argv and its complete environment."""

    argv: list[str]
    env: Mapping[str, str] | None = None


def run_group(commands: Sequence[Command], *, grace: float = 5.0, poll: float = 0.2) -> int:
    """Start every command, wait for all; 0 if all succeed.

    As soon as one fails (or is killed) the others are stopped: SIGTERM to each process
    group, then SIGKILL after ``grace`` seconds (a multi-process job cannot go on without
    one of its processes); at the end, helpers a process left behind in its group (e.g. a
    local Ray) are stopped the same way. Returns the first failure's exit code (negative: a signal).
    """
    procs = [
        subprocess.Popen(
            c.argv, env=dict(c.env) if c.env is not None else None, start_new_session=True
        )
        for c in commands
    ]
    for i, p in enumerate(procs):
        logger.info("process %d: pid %d", i, p.pid)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                logger.warning("process %d exited with %d: stopping the others", index, code)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    finally:
        stop_groups(procs, grace)


def with_retries(attempt: Callable[[int], int], retries: int) -> int:
    """Call ``attempt(k)`` for k = 0, 1, ... until it returns 0 or ``retries`` relaunches are spent."""
    code = 0
    for k in range(retries + 1):
        if k:
            logger.warning(
                "attempt %d of %d failed (exit %d): relaunching; a train run resumes from its latest checkpoint",
                k,
                retries + 1,
                code,
            )
        code = attempt(k)
        if code == 0:
            return 0
    return code
