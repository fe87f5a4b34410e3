"""Sharded training on real multi-device and multi-process JAX (CPU), via subprocesses.

The device count is fixed when JAX starts, so the cases run `sharded_run.py` in fresh
processes with `--xla_force_host_platform_device_count`: one pair of processes (4 devices
each) for every multi-process case, then one process of 8 devices for every one-process case
(the reload of the pair's checkpoint among them), each started once for the whole file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loomax.distributed.net import free_port

WORKER = Path(__file__).with_name("sharded_run.py")

MESH_RTOL = 1e-5
"""Losses on different meshes agree to this, not bit for bit: splitting a batch or a matrix
over other devices changes the order of the float32 sums (per-device partial sums, then
an all-reduce), and float addition is not associative. Everything that involves no such
reduction (the saved bits, a reload on another mesh, the same run on every process) is
compared exactly."""


def worker_env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }


def run_worker(args, devices, timeout=600):
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env=worker_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


MESHES = [[1, 1, 1, 1], [1, 4, 2, 8], [2, 2, 2, 8], [1, 4, 1, 4]]
"""The GPT-2's meshes (replica, data, model, devices): one device, FSDP x TP, all three, and
FSDP alone on the four devices the two processes hold. The one device starts from a fresh
init, the others from the pair's step-0 checkpoint (their init is the pair's, so the same
losses also say that the two processes' sharded init is that of one device)."""
SIGTERM_AT = 3
"""The pair's third run sends SIGTERM to process 1 alone, after this step (of 5)."""


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, processes_support):
    """The pair's runs (see `sharded_run.py process`): their run dir and results."""
    return run_two_processes(
        tmp_path_factory.mktemp("two-processes"), processes_support, str(SIGTERM_AT), devices=4
    )


@pytest.fixture(scope="module")
def one_process(two_process_run):
    """The one-process cases, the reload of the pair's final checkpoint on other meshes last."""
    run_dir, _ = two_process_run
    cases = {
        "meshes": MESHES,
        "start": str(run_dir / "checkpoints" / "step-0"),
        "llama": [[2, 1, 1, 1, 1], [2, 1, 2, 2, 4], [1, 1, 1, 1, 1], [1, 1, 2, 2, 4]],
        "mixtral": [[1, 1, 1, 1], [1, 4, 2, 8]],
        "context": str(run_dir.with_name(run_dir.name + "-context") / "checkpoints" / "step-0"),
        "load": [str(run_dir / "checkpoints"), [[1, 1, 1, 1], [1, 4, 2, 8], [2, 2, 2, 8]]],
    }
    return result_of(run_worker(["suite", json.dumps(cases)], devices=8))


@pytest.fixture(scope="module")
def mesh_runs(one_process):
    return one_process["meshes"]


@pytest.mark.slow
def test_same_loss_trajectory_on_every_mesh(mesh_runs):
    single = mesh_runs[0]
    assert single["mesh"] == {
        "replica": 1,
        "data": 1,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    for run in mesh_runs[1:]:
        np.testing.assert_allclose(run["losses"], single["losses"], rtol=MESH_RTOL)
        assert run["final_step"] == 5
    assert [r["mesh"] for r in mesh_runs[1:3]] == [
        {"replica": 1, "data": 4, "expert": 1, "context": 1, "model": 2, "stage": 1},
        {"replica": 2, "data": 2, "expert": 1, "context": 1, "model": 2, "stage": 1},
    ]


@pytest.mark.slow
def test_activation_statistics_are_global_on_every_mesh(mesh_runs):
    single = mesh_runs[0]["activations"]
    assert "activations/layer_1/mlp_out/rms" in single and "activations/logits/std" in single
    for run in mesh_runs[1:]:
        stats = run["activations"]
        assert stats.keys() == single.keys()
        for key, value in single.items():  # the whole tensor's, not one device's shard
            tol = 2e-3 if key.endswith("near_zero") else 1e-4  # a few values at the threshold
            np.testing.assert_allclose(stats[key], value, rtol=tol, atol=tol, err_msg=key)


@pytest.mark.slow
def test_parameters_and_optimizer_state_are_sharded_as_declared(mesh_runs):
    by_mesh = {tuple(r["mesh"].values()): r["specs"] for r in mesh_runs}
    fsdp_tp = by_mesh[(1, 4, 1, 1, 2, 1)]
    assert fsdp_tp["embedding"] == "P(None, 'data')"  # (vocab, embed): FSDP on embed
    assert fsdp_tp["mlp_up_axes"] == ["layers", "mlp", "embed"]
    assert fsdp_tp["mlp_up"] == "P(None, 'model', 'data')"  # TP on mlp, FSDP on embed
    assert fsdp_tp["adam_mu_mlp_up"] == fsdp_tp["mlp_up"]  # optimizer state rests like the params
    assert by_mesh[(1, 4, 1, 1, 1, 1)]["embedding_shard_shape"] == [64, 32 // 4]
    assert by_mesh[(1, 4, 1, 1, 2, 1)]["embedding_shard_shape"] == [64, 32 // 4]
    assert by_mesh[(1, 1, 1, 1, 1, 1)]["embedding_shard_shape"] == [64, 32]


@pytest.mark.slow
def test_grouped_query_llama_splits_kv_heads_when_they_divide_and_keeps_them_whole_otherwise(
    one_process,
):
    gqa_1, gqa_tp, mqa_1, mqa_tp = one_process["llama"]
    assert gqa_tp["k_proj_axes"] == ["layers", "kv_heads", "head_size", "embed"]
    assert gqa_tp["k_proj_spec"] == "P(None, 'model', None, 'data')"  # 2 KV heads over model=2
    assert mqa_tp["k_proj_spec"] == "P(None, None, None, 'data')"  # 1 KV head: kept whole
    assert mqa_tp["kept_whole"] == [
        "parameter mapping: 'kv_heads' (size 1) does not split 2 ways over model: kept whole on every device"
    ]
    assert gqa_tp["kept_whole"] == [] and mqa_1["kept_whole"] == []
    for one, tp in ((gqa_1, gqa_tp), (mqa_1, mqa_tp)):
        np.testing.assert_allclose(tp["losses"], one["losses"], rtol=MESH_RTOL)


@pytest.mark.slow
def test_mixtral_on_fsdp_and_tensor_parallel_meshes_gives_the_losses_of_one_device(one_process):
    """A mixture of experts (global sort by expert, grouped matmuls) under data=4 x model=2:
    XLA partitions it, with the same losses and balance losses as one device."""
    one, sharded = one_process["mixtral"]
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=MESH_RTOL)
    np.testing.assert_allclose(sharded["load_balance"], one["load_balance"], rtol=MESH_RTOL)
    assert len(one["losses"]) == 5


def run_two_processes(
    directory, support, *extra: str, mode: str = "process", devices: int = 2
) -> tuple[Path, list[dict]]:
    """Two JAX processes of ``devices`` devices each running the worker's ``mode`` (its
    arguments: ID COUNT PORT RUN_DIR ``extra``); their run dir and results. Both are killed
    when one fails (its stderr is shown), and the whole run is redone once if the
    coordinator's port (`free_port`) was taken before process 0 bound it."""

    def scenario(processes) -> tuple[Path, list[dict]]:
        port = free_port("")
        run_dir = processes.directory / "run"
        env = worker_env(devices=devices)
        for i in range(2):
            args = [mode, str(i), "2", str(port), str(run_dir), *extra]
            processes.start(f"process{i}", [sys.executable, str(WORKER), *args], env)
        outputs = processes.wait(timeout=600)
        return run_dir, [
            json.loads(outputs[f"process{i}"].strip().splitlines()[-1]) for i in range(2)
        ]

    return support.run_scenario(directory, scenario)


@pytest.mark.slow
def test_two_processes_match_one_process_with_four_devices(mesh_runs, two_process_run):
    _, results = two_process_run
    four_devices = mesh_runs[3]
    assert four_devices["mesh"] == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    for i, result in enumerate(results):
        assert (result["process_index"], result["process_count"]) == (i, 2)
        assert result["mesh"] == four_devices["mesh"]
        np.testing.assert_allclose(result["losses"], four_devices["losses"], rtol=MESH_RTOL)
    assert results[0]["losses"] == results[1]["losses"]  # one replicated value: exact


@pytest.mark.slow
def test_checkpoint_from_two_processes_reshards_onto_other_meshes(two_process_run, one_process):
    run_dir, results = two_process_run
    checkpoints = run_dir / "checkpoints"
    meta = json.loads((checkpoints / "step-5" / "metadata.json").read_text())
    total = sum(
        np.prod(e["shape"], dtype=np.int64) * np.dtype(e["dtype"]).itemsize
        for e in meta["arrays"].values()
    )
    written = [r["saved_bytes"] for r in results]
    assert sum(written) == total  # each shard written once, by the process that owns it
    assert all(0.4 * total < w < 0.6 * total for w in written)  # FSDP: half each
    assert meta["process_count"] == 2 and meta["mesh"] == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }

    loads = one_process["load"]
    one_device = loads[0]
    assert one_device["step"] == 5 and one_device["mlp_up_shard_shape"] == [2, 128, 32]
    assert loads[1]["mlp_up_spec"] == "P(None, 'model', 'data')"
    assert loads[1]["mlp_up_shard_shape"] == [2, 64, 8]
    assert results[0]["digest"] == results[1]["digest"]
    for loaded in loads:  # the saved bits, exactly, whatever the mesh
        assert loaded["digest"] == results[0]["digest"]


@pytest.mark.slow
def test_sigterm_on_one_process_stops_all_at_the_same_step(two_process_run):
    run_dir, pair = two_process_run  # the pair's third run: SIGTERM to process 1 after step 3
    results = [r["sigterm"] for r in pair]
    steps = {r["final_step"] for r in results}
    assert len(steps) == 1 and steps <= {3, 4}  # process 0 learns of it at step 3 or 4
    stopped = steps.pop()
    assert all("signal SIGTERM (process 1)" in r["stop_reason"] for r in results)
    checkpoints = run_dir.with_name(run_dir.name + "-sigterm") / "checkpoints"
    meta = json.loads((checkpoints / f"step-{stopped}" / "metadata.json").read_text())
    assert meta["permanent"] is False and sum(r["saved_bytes"] for r in results) > 0


@pytest.mark.slow
def test_context_groups_spanning_two_processes_train_as_one_process(two_process_run, one_process):
    """Data 2 x context 4 over two processes of 4 devices, interleaved: every context group
    holds devices of both, at every other place along the ring, so both load the same rows
    (row block 0 of 1) and each device takes its batch position's. Five steps and an eval
    match one process with the same 8 devices to ``MESH_RTOL`` (measured: the losses bit
    for bit, the eval loss to 1.1e-7; the weights differ in their last bits, as the
    processes' all-reduces go through gloo, which sums in another order); the two processes
    agree exactly. The one process starts from the pair's step-0 checkpoint (its init
    compiled once); that the pair's sharded init is one device's, the GPT-2's meshes say."""
    results = [r["context"] for r in two_process_run[1]]
    single = one_process["context"]
    assert single["row_block"] == [0, 1] and not single["spans_processes"]
    assert len(single["losses"]) == 5
    for i, result in enumerate(results):
        assert result["process_index"] == i and result["spans_processes"]
        assert result["processes"] == [0, 1] * 4  # along each context group, alternating
        assert result["mesh"] == single["mesh"] and result["row_block"] == [0, 1]
        np.testing.assert_allclose(result["losses"], single["losses"], rtol=MESH_RTOL)
        np.testing.assert_allclose(result["eval_loss"], single["eval_loss"], rtol=MESH_RTOL)
    first, second = results
    assert first["losses"] == second["losses"] and first["eval_loss"] == second["eval_loss"]
    assert first["digest"] == second["digest"]
