"""How hard a build task presses on the CPUs it shares with a training process.

A streaming run's build past its first chunk runs nice (`PieceJob.nice`), so that the
training process next to it compiles and steps at nearly full speed. Niceness alone does not
do that on Linux with autogroups (`/proc/sys/kernel/sched_autogroup_enabled`): the kernel
first shares CPU time between autogroups, one per session, and only then weighs the
niceness of the processes inside each. A Ray node started on its own (`ray start`, a pod's
Ray, a shared head) is a session of its own, so its nice-19 worker still took ~half of a
2-core machine from a training process in another session. So a task also gives its Ray
node's autogroup the job's niceness, when that autogroup is not the driver's (a local Ray
started by the training process shares its session: niceness inside it already works, and
niceing the group would slow the training process too). A task at niceness 0 sets the
group back to 0 (raising a nice value needs no privilege; lowering it back to 0 neither).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_NICED: list[int] = []
"""The niceness this process was raised to by a task's `nice`, once (a worker runs many)."""


DEFAULT_AUTOGROUP = "default"
"""`autogroup_id`'s name for the kernel's default autogroup: that of processes whose session
never called `setsid` (init's, and a container's whose entry point never did). Its file
under /proc reads empty, and its nice value cannot be set."""


def _autogroup_line(pid: int | str = "self") -> str | None:
    """The text of `/proc/<pid>/autogroup` ("" in the default autogroup); None where the
    kernel has no autogroups (or the file cannot be read)."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().strip()
    except OSError:
        return None


def parse_autogroup(line: str | None) -> tuple[str, int | None] | None:
    """`(name, nice)` of a `/proc/<pid>/autogroup` text: `("/autogroup-7", 0)` for
    "/autogroup-7 nice 0", `(DEFAULT_AUTOGROUP, None)` for the default group's empty text, and
    None for no text (no autogroups)."""
    if line is None:
        return None
    fields = line.split()
    if not fields:
        return DEFAULT_AUTOGROUP, None
    try:
        return fields[0], int(fields[-1])
    except ValueError:
        return fields[0], None


def _boot_id() -> str:
    """This boot's id (the host's name where the kernel does not say): autogroup numbers are
    unique only within one boot of one host."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename


def autogroup_id() -> str | None:
    """This process's autogroup as `<boot id>/<autogroup>` (unique across hosts and boots;
    `<boot id>/default` in the default group); None where the kernel has no autogroups."""
    group = parse_autogroup(_autogroup_line())
    return None if group is None else f"{_boot_id()}/{group[0]}"


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of process `pid`'s autogroup; None where the kernel has no autogroups
    or the process is in the default autogroup (which has none)."""
    group = parse_autogroup(_autogroup_line(pid))
    return None if group is None else group[1]


def set_task_priority(nice: int, driver_autogroup: str | None) -> None:
    """Runs this task's process at `nice`: its own niceness is raised once (it cannot be
    lowered again), and its autogroup's nice is set to `nice` when that autogroup is not the
    driver's (`driver_autogroup`, the `autogroup_id` of the process that started the build)."""
    if nice and not _NICED:
        _NICED.append(os.nice(nice))
    own = autogroup_id()
    if own is None or driver_autogroup is None or own == driver_autogroup:
        return
    if own.endswith(f"/{DEFAULT_AUTOGROUP}"):  # shared with every setsid-less process: left be
        return
    if autogroup_nice() == nice:
        return
    for _ in range(40):  # the kernel takes one autogroup nice value per 0.1 s from non-admins
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
            return
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:  # not allowed here: the process's own niceness still holds
            return
