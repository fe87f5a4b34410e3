"""``--target local``: N JAX processes on this machine (CPU devices), the same code path as a pod."""

from __future__ import annotations

import os
import re
import sys

from loomax.distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV
from loomax.launch.config import LaunchConfig
from loomax.launch.job import Job
from loomax.launch.processes import Command


def local_commands(config: LaunchConfig, job: Job, port: int) -> list[Command]:
    """One ``python -m loomax.cli ...`` per process, coordinated on ``127.0.0.1:port``."""
    base = {**os.environ, **job.env}
    base.setdefault("JAX_PLATFORMS", "cpu")
    base["XLA_FLAGS"] = _with_device_count(base.get("XLA_FLAGS", ""), config.devices_per_process)
    commands = []
    for i in range(config.num_processes):
        env = {
            **base,
            COORDINATOR_ENV: f"127.0.0.1:{port}",
            NUM_PROCESSES_ENV: str(config.num_processes),
            PROCESS_ID_ENV: str(i),
        }
        commands.append(Command([sys.executable, "-m", "loomax.cli", *job.args], env))
    return commands


def _with_device_count(flags: str, count: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).strip()
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()
