"""Running a test worker script in a fresh process on N fake CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def worker_env(devices: int) -> dict[str, str]:
    """This environment with JAX on `devices` fake CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def run_json_worker(worker: Path, *args: str, devices: int = 8, timeout: float = 600) -> dict:
    """Runs `python worker ARGS` on `devices` fake CPU devices; the JSON of its last stdout
    line (the test fails with the worker's stderr when it does)."""
    proc = subprocess.run(
        [sys.executable, str(worker), *args],
        env=worker_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
