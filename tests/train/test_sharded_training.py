"""Sharded training on real multi-device and multi-process JAX (CPU), via subprocesses.

The device count is fixed when JAX starts, so each case runs `sharded_run.py` in a fresh
process with `--xla_force_host_platform_device_count`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("sharded_run.py")


def run_worker(args, devices, timeout=600):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mesh_runs():
    meshes = [[1, 1, 1, 1], [1, 8, 1, 8], [1, 4, 2, 8], [2, 2, 2, 8], [1, 4, 1, 4]]
    return result_of(run_worker(["meshes", json.dumps(meshes)], devices=8))


@pytest.mark.slow
def test_same_loss_trajectory_on_every_mesh(mesh_runs):
    single = mesh_runs[0]
    assert single["mesh"] == {"replica": 1, "data": 1, "model": 1}
    for run in mesh_runs[1:]:
        np.testing.assert_allclose(run["losses"], single["losses"], rtol=1e-5)
        assert run["final_step"] == 5
    assert [r["mesh"] for r in mesh_runs[1:4]] == [
        {"replica": 1, "data": 8, "model": 1},
        {"replica": 1, "data": 4, "model": 2},
        {"replica": 2, "data": 2, "model": 2},
    ]


@pytest.mark.slow
def test_parameters_and_optimizer_state_are_sharded_as_declared(mesh_runs):
    by_mesh = {tuple(r["mesh"].values()): r["specs"] for r in mesh_runs}
    fsdp_tp = by_mesh[(1, 4, 2)]
    assert fsdp_tp["embedding"] == "P(None, 'data')"  # (vocab, embed): FSDP on embed
    assert fsdp_tp["mlp_up_axes"] == ["layers", "mlp", "embed"]
    assert fsdp_tp["mlp_up"] == "P(None, 'model', 'data')"  # TP on mlp, FSDP on embed
    assert fsdp_tp["adam_mu_mlp_up"] == fsdp_tp["mlp_up"]  # optimizer state rests like the params
    assert by_mesh[(1, 8, 1)]["embedding_shard_shape"] == [64, 32 // 8]
    assert by_mesh[(1, 4, 2)]["embedding_shard_shape"] == [64, 32 // 4]
    assert by_mesh[(1, 1, 1)]["embedding_shard_shape"] == [64, 32]


@pytest.mark.slow
def test_two_processes_match_one_process_with_four_devices(mesh_runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [run_worker(["process", str(i), "2", str(port)], devices=2) for i in range(2)]
    results = [result_of(p) for p in procs]
    four_devices = mesh_runs[4]
    assert four_devices["mesh"] == {"replica": 1, "data": 4, "model": 1}
    for i, result in enumerate(results):
        assert (result["process_index"], result["process_count"]) == (i, 2)
        assert result["mesh"] == four_devices["mesh"]
        np.testing.assert_allclose(result["losses"], four_devices["losses"], rtol=1e-5)
