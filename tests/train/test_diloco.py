"""DiLoCo on 8 CPU devices (subprocesses: the device count is fixed when JAX starts).

`diloco_run.py suite` trains each scenario with the Trainer and with a plain-JAX reference
of the algorithm on one device; these tests compare what it prints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from loomax.distributed.net import free_port

LOSS_RTOL = 1e-5
"""Per-worker losses, trainer vs reference: a worker's batch is split over 2 or 4 devices in
the trainer and not in the reference, so float sums differ in order (see MESH_RTOL)."""


WORKER = Path(__file__).with_name("diloco_run.py")


def worker_env(devices: int) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory, json_worker):
    run_dir = tmp_path_factory.mktemp("diloco")
    return json_worker(WORKER, "suite", str(run_dir))


@pytest.mark.slow
def test_two_workers_two_fragments_equal_the_reference_step_for_step(suite):
    run = suite["streaming"]
    np.testing.assert_allclose(run["losses"], run["ref_losses"], rtol=LOSS_RTOL)
    assert run["diff"]["moved"] > 0.05  # the workers drifted apart from the shared model...
    assert run["diff"]["shared"] < 1e-5  # ...and the trainer's models are the reference's
    assert run["diff"]["workers"] < 1e-5
    assert run["bf16_sums"] == 0  # pseudo-gradients in float32 unless asked


@pytest.mark.slow
def test_four_workers_with_adam_and_bf16_pseudo_gradients_equal_the_reference(suite):
    run = suite["four"]
    np.testing.assert_allclose(run["losses"], run["ref_losses"], rtol=LOSS_RTOL)
    # Adam divides by the root of tiny second moments and bf16 rounds at 2^-8: a last-bit
    # difference of a sum can move a weight by ~1e-4, far below what a wrong step moves
    assert run["diff"]["shared"] < 1e-3
    assert run["bf16_sums"] == 16  # one bf16 sum over the workers per parameter array


@pytest.mark.slow
def test_inner_steps_issue_no_collective_across_replica(suite):
    inner, sync = suite["streaming"]["inner"], suite["streaming"]["sync"]
    assert inner["collectives"] > 0  # FSDP over `data` inside each worker...
    assert inner["cross"] == [] and inner["cross_bytes"] == 0  # ...but nothing between workers
    assert sync["cross"] == ["all-reduce"] and sync["cross_bytes"] > 0  # the fragment's mean
    assert suite["dp"]["dp_step"]["cross"] != []  # the check sees a data-parallel step's
    assert sync["cross_bytes"] < suite["dp"]["dp_step"]["cross_bytes"]


@pytest.mark.slow
def test_one_inner_step_and_outer_sgd_at_lr_1_is_data_parallel_sgd(suite):
    run = suite["dp"]
    np.testing.assert_allclose(run["diloco_losses"], run["dp_losses"], rtol=LOSS_RTOL)
    assert run["diloco_losses"] == pytest.approx(run["worker_mean"], rel=1e-7)  # logged = mean
    assert run["diff"] < 1e-6  # mean of (w - lr g_i) = w - lr mean(g_i), up to rounding


@pytest.mark.slow
def test_resume_in_the_middle_of_a_period_is_exact(suite):
    run = suite["streaming"]
    assert run["resumed_digest"] == run["digest"]  # workers, inner and outer states: bitwise


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_same_devices(suite, tmp_path, processes_support):
    def scenario(processes):
        port = free_port("")
        for i in range(2):
            run_dir = str(processes.directory / "run")
            args = ["process", str(i), "2", str(port), run_dir, suite["streaming"]["start"]]
            processes.start(f"p{i}", [sys.executable, str(WORKER), *args], worker_env(4))
        outputs = processes.wait(timeout=600)
        return [json.loads(outputs[f"p{i}"].strip().splitlines()[-1]) for i in range(2)]

    # both processes start from the one process's step-0 checkpoint (its init, exactly):
    # that a pair's sharded fresh init is one process's, test_sharded_training's pair says
    results = processes_support.run_scenario(tmp_path, scenario)
    one = suite["streaming"]
    for i, result in enumerate(results):  # process i holds worker i (mesh devices in process order)
        assert result["process_index"] == i and len(result["losses"]) == 1
        np.testing.assert_allclose(result["losses"][0], one["losses"][i], rtol=LOSS_RTOL)
        assert result["logged"] == result["losses"][0]  # a process logs the workers it holds
    assert results[0]["digest"] == results[1]["digest"]  # the shared state: one value, exact
