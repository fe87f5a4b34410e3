"""`loomax compile` / `loomax plan` for GPU topologies, on a host without a GPU: tiny GPT-2 and
Llama compiled for `h100:8` through the trainer's own code path, FSDP's state per GPU, a
model that cannot fit, bad input, and the ranked plan."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("cuda_plugin")  # in the test extra: fails, not skips

from loomax.cli import main  # noqa: E402
from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.plan import gpus  # noqa: E402
from loomax.plan.compile import compile_run  # noqa: E402
from loomax.plan.gpus import GPUS, parse_gpu_topology  # noqa: E402
from loomax.plan.report import compile_text, plan_table  # noqa: E402
from loomax.plan.search import search  # noqa: E402
from loomax.plan.topology import TopologyError, check_topology_name, get_topology  # noqa: E402


@pytest.fixture(scope="session")
def cuda_plugin() -> None:
    """JAX's CUDA plugin and ptxas are in the `test` extra (`gpu-plan`): fail, don't skip."""
    gpus.check_cuda_plugin()


H100S = "h100:8"
REPLICATED = ("--trainer.mesh.data", "8", "--trainer.fsdp_axis", "null")
"""Plain data parallel over the 8 GPUs (what ``loomax plan`` calls ``dp 8x1``)."""


def test_gpu_topology_names():
    assert parse_gpu_topology("h100:8") == ("h100", 1, 8)
    assert parse_gpu_topology("A100-80G:4x8") == ("a100-80g", 4, 8)
    for bad in ("h900:8", "h100:0", "h100:8x", "b200", "h100-8"):
        with pytest.raises(TopologyError, match="h100, h200, a100-80g, b200"):
            check_topology_name(bad)


def test_an_unknown_gpu_lists_the_known_ones_before_any_compile(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--topology", "h900:8", "--model.vocab_size", "512"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown topology 'h900:8'" in err and "h100, h200, a100-80g, b200" in err


def test_a_mesh_that_does_not_divide_the_gpus_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--topology", "h100:2x8", "--trainer.mesh.model", "3"])
    assert exit_info.value.code == 2
    assert "do not divide the 16 devices (topology h100:2x8)" in capsys.readouterr().err


def test_the_plugin_missing_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpus, "_installed", lambda module: False)
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    with pytest.raises(TopologyError, match=r"CUDA plugin and ptxas .*'loomax\[gpu-plan\]'"):
        get_topology("h100:8")


def test_the_topologies_are_the_gpus_of_their_spec_sheets(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    for name, spec in GPUS.items():
        topology = get_topology(f"{name}:2x4")
        assert topology.num_devices == 8 and topology.platform == "gpu"
        assert {d.process_index for d in topology.devices} == {0, 1}  # two hosts
        assert topology.hbm_per_device == int(0.75 * spec.memory_bytes)  # JAX's default part
        assert topology.peak_per_device == spec.peak_bf16
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert get_topology("h100:8").hbm_per_device == int(0.9 * GPUS["h100"].memory_bytes)


@pytest.mark.slow  # seconds each: the module goes early in `make test`, not in its tail
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_tiny_models_compile_for_eight_h100s(model, plan_runs):
    result = plan_runs.compiled(model, H100S)
    assert result.devices == 8 and result.mesh == {
        "replica": 1,
        "data": 8,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    assert result.platform == "gpu" and result.chip == "NVIDIA H100 80GB HBM3"
    assert result.fits is True and result.error is None and result.compiled
    assert 0 < result.temp_bytes < result.total_bytes < result.hbm_bytes
    assert result.memory_fraction == 0.75
    # the best end is the roofline: executed matmul FLOPs at peak, or the moved bytes at HBM
    # bandwidth; the expected end is that at the efficiency fitted to the H200 runs
    assert result.estimate == "roofline"
    spec = GPUS["h100"]
    assert result.est_best_s >= result.step_flops / 8 / spec.peak_bf16
    assert result.est_best_s >= result.total_bytes / spec.bandwidth * 0.99
    assert result.est_best_s <= result.est_step_s < result.est_worst_s
    assert 0 < result.est_worst_mfu < result.est_mfu <= result.est_best_mfu <= 1
    text = compile_text(result)
    assert "memory per GPU:" in text and "of 59.74 GiB (75% of 79.65 GiB" in text
    assert "best = roofline lower bound]" in text and "FITS" in text
    assert "at 450 GB/s a device (NVLink" in text  # H100: 900 GB/s both ways


def test_collectives_across_hosts_are_charged_at_the_network_bandwidth(plan_runs):
    """FSDP over 8 GPUs on two hosts: groups of 8 span both, so their bytes go at one
    InfiniBand NIC's 50 GB/s a GPU, not NVLink's 450: the communication term grows."""
    one_host = plan_runs.compiled("llama", H100S)
    two_hosts = plan_runs.compiled("llama", "h100:2x4")
    assert two_hosts.comm_bytes == pytest.approx(one_host.comm_bytes, rel=0.05)
    assert two_hosts.comm_s > 5 * one_host.comm_s
    assert "groups larger than one host at 50.0 GB/s (InfiniBand)" in " ".join(
        two_hosts.assumptions
    )


def test_fsdp_over_eight_gpus_holds_an_eighth_of_the_replicated_state(plan_runs):
    fsdp = plan_runs.compiled("llama", H100S)
    replicated = plan_runs.compiled("llama", H100S, *REPLICATED)
    assert replicated.fits and replicated.compiled
    # every parameter has an embed axis (64, split 8 ways); scalars (step, count, key) repeat
    gap = replicated.state_bytes - 8 * fsdp.state_bytes
    assert abs(gap) <= 8 * 64, (replicated.state_bytes, fsdp.state_bytes)


def test_llama_8b_on_one_a100_does_not_fit(repo_root):
    config = parse_config(
        TrainLmConfig, repo_root / "config" / "llama_8b.yaml", ["--trainer.train_batch_size", "1"]
    )
    result = compile_run(config, get_topology("a100-80g:1"))
    assert result.fits is False and not result.compiled  # refused before compiling
    assert result.state_bytes > 80 * 2**30  # 12 bytes per parameter, unsharded
    text = compile_text(result)
    assert "8,030.3M parameters" in text and "DOES NOT FIT" in text


def test_plan_ranks_the_gpu_candidates_that_fit(monkeypatch, plan_runs):
    """The run's own strategy (FSDP over 8) and plain data parallel, ranked by their roofline
    step time (both compiled once for the tests above, and reused)."""
    config = plan_runs.tiny("llama")

    def compile_once(candidate_config, topology):
        # the run's own names its mesh (data 8): the program of data -1 on 8 GPUs
        for named, flags in ((("--trainer.mesh.data", "8"), ()), (REPLICATED, REPLICATED)):
            if candidate_config == plan_runs.tiny("llama", *named):
                return plan_runs.compiled("llama", H100S, *flags)
        return compile_run(candidate_config, topology)

    monkeypatch.setattr("loomax.plan.search.compile_run", compile_once)
    ranked = search(config, get_topology(H100S), max_candidates=2, progress=False)
    assert sorted(r.candidate.label for r in ranked) == ["dp 8x1", "fsdp 8x1 (the run's)"]
    assert all(r.result and r.result.fits for r in ranked)
    steps = [r.result.est_step_s for r in ranked]
    assert steps == sorted(steps)
    dp = next(r.result for r in ranked if r.candidate.label == "dp 8x1")
    assert (
        dp.state_bytes > 7 * plan_runs.compiled("llama", H100S).state_bytes
    )  # parameters and moments whole
    table = plan_table(ranked)
    assert "fsdp 8x1 (the run's)" in table and "yes" in table


def test_xla_expands_ragged_dot_to_a_dense_matmul_on_gpu():
    """What the plan's count charges for ``ragged_dot`` (plan/flops.py): XLA's GPU compiler
    (JAX 0.10, CUDA plugin) multiplies every row by every group's weights, masking the rows
    into ``[G, m, k]`` (a batched GEMM, then a sum over groups) or ``[m, G*k]`` (one GEMM, at
    larger sizes): G times the routed work. Fails when XLA learns a grouped GEMM."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    (device,), _, _ = gpus.gpu_devices("h100:1")
    m, k, n, groups = 256, 64, 128, 8
    place = SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=place)
        for shape, dtype in (((m, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16))
    ]
    args.append(jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=place))
    hlo = jax.jit(jax.lax.ragged_dot).lower(*args).compile().as_text()
    dense = (f"bf16[{groups},{m},{k}]", f"bf16[{m},{groups * k}]")
    assert any(shape in line for line in hlo.splitlines() if "dot" in line for shape in dense)
