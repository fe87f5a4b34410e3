"""The package's public names, and what importing it pulls in."""

from __future__ import annotations

import subprocess
import sys

import loomax.distributed


def test_importing_the_package_imports_neither_ray_nor_jax():
    code = (
        "import sys, loomax.distributed; assert 'ray' not in sys.modules, 'ray was imported';"
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_names():
    assert sorted(loomax.distributed.__all__) == sorted(
        [
            "COORDINATOR_ENV",
            "NUM_PROCESSES_ENV",
            "PROCESS_ID_ENV",
            "DistributedConfig",
            "RayConfig",
            "barrier",
            "broadcast_str",
            "coordination_client",
            "init_ray",
            "pod_ray_cluster",
            "pod_ray_role",
            "ray_session",
        ]
    )
    assert all(hasattr(loomax.distributed, name) for name in loomax.distributed.__all__)
