"""Ray on a pod: process 0 starts the head, a process on another host joins it."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomax.distributed import RayConfig, pod_ray_role
from loomax.distributed.net import free_port

pytestmark = pytest.mark.usefixtures("machine_ray_lock")  # a machine-wide Ray cluster

WORKER = Path(__file__).with_name("pod_ray_worker.py")


@pytest.mark.parametrize(
    "config, hosts, roles",
    [
        (RayConfig(), ["a", "a"], ["none", "none"]),  # one host: a local Ray on process 0
        (RayConfig(), ["a", "a", "b", "b"], ["head", "idle", "join", "idle"]),
        (RayConfig(address="10.0.0.9:6379"), ["a", "b"], ["none", "none"]),  # a cluster to join
        (RayConfig(auto_start_cluster=False), ["a", "b"], ["none", "none"]),
    ],
)
def test_roles(monkeypatch, config, hosts, roles):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert [pod_ray_role(config, hosts, i) for i in range(len(hosts))] == roles


def test_ray_address_variable_means_no_pod_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert pod_ray_role(RayConfig(), ["a", "b"], 0) == "none"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A Ray temp dir of the test's own, short: Ray's socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_head_on_process_0_and_the_other_host_joins(tmp_path, processes_support, ray_tmp):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)

    def scenario(processes) -> str:
        port = free_port("")  # the coordinator's: the scenario is rerun once if it was taken
        for i in range(2):
            processes.start(f"process{i}", [sys.executable, str(WORKER), str(i), str(port)], env)
        return processes.wait(timeout=300)["process0"]

    out = processes_support.run_scenario(tmp_path, scenario)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["nodes"] == 2 and result["cpus"] == 2.0  # the head's CPU and the joined one
    assert result["auth_mode"] == "token"  # the pod's cluster is token-protected
    # `ray start --head` recorded the head for later ray.init() calls; once the head is
    # stopped the record is gone, as after `ray stop` (else ray.init() joins a dead cluster)
    assert result["address_file"] == result["address"]
    assert not (ray_tmp / "ray" / "ray_current_cluster").exists()
