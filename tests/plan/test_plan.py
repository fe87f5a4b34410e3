"""`loomax plan`: ranks candidates; its overlay parses and trains on the local CPU mesh."""

from __future__ import annotations

import types

import pytest

from loomax.benchmark import run_benchmark
from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig
from loomax.plan.candidates import (
    apply_overrides,
    as_flags,
    batch_split_error,
    context_strategies,
    mesh_strategies,
    nested,
    num_experts_of,
    offload_variants,
    remat_variants,
    run_default,
)
from loomax.plan.report import best, overlay_yaml, plan_table
from loomax.plan.search import search
from loomax.plan.topology import get_topology

requires_libtpu = pytest.mark.usefixtures("libtpu")  # fails, not skips, without it


def test_mesh_strategies_cover_fsdp_dp_and_tensor_parallel():
    labels = [c.label for c in mesh_strategies(8)]
    assert labels[:2] == ["fsdp 8x1", "dp 8x1"]
    assert "fsdp tp2 4x2" in labels and "dp tp4 2x4" in labels and "fsdp tp8 1x8" in labels
    two_slices = mesh_strategies(8, num_slices=2)
    assert two_slices[0].overrides["trainer.mesh"] == {
        "replica": 2,
        "data": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
    }


def test_long_sequences_get_context_parallel_candidates():
    assert context_strategies(8, 1, 4096) == []
    long = context_strategies(8, 1, 32768)
    assert [c.label for c in long] == ["fsdp cp2 4x2", "fsdp cp4 2x4", "fsdp cp8 1x8"]
    assert long[1].overrides["trainer.mesh"] == {
        "replica": 1,
        "data": 2,
        "expert": 1,
        "context": 4,
        "model": 1,
    }
    assert [c.label for c in context_strategies(8, 1, 16388)] == ["fsdp cp2 4x2"]  # 16388 % 8
    config = apply_overrides(parse_config(TrainLmConfig, None, []), long[1].overrides)
    assert config.trainer.mesh.context == 4 and config.trainer.mesh.resolve(8)["data"] == 2


def test_long_rows_get_the_context_splits_that_divide_the_batch():
    """With the batch known, the context sizes go past 8 where few long rows need it: the
    three smallest whose data-parallel devices split the batch (Llama-8B at 128k, 32 rows on
    64 chips; at 1M, 16 rows on 256)."""
    labels = [c.label for c in context_strategies(64, 1, 131072, batch=32)]
    assert labels == ["fsdp cp2 32x2", "fsdp cp4 16x4", "fsdp cp8 8x8"]
    labels = [c.label for c in context_strategies(256, 1, 1 << 20, batch=16)]
    assert labels == ["fsdp cp16 16x16", "fsdp cp32 8x32", "fsdp cp64 4x64"]
    assert context_strategies(64, 1, 8192, batch=32) == []
    config = parse_config(TrainLmConfig, None, ["--trainer.train_batch_size", "32"])
    fsdp = mesh_strategies(64)[0]
    assert batch_split_error(fsdp, config) == (
        "not compiled: trainer.train_batch_size (32) does not split over its 64 "
        "data-parallel devices (replica x data x expert)"
    )
    assert batch_split_error(context_strategies(64, 1, 131072, batch=32)[2], config) is None
    lenient = apply_overrides(config, {"trainer.allow_nondivisible_batch_size": True})
    assert batch_split_error(fsdp, lenient) is None


def test_plan_reports_meshes_that_cannot_split_the_batch_without_compiling(monkeypatch):
    """Two rows of 32,768 on 8 devices: only context 4 and 8 leave few enough data-parallel
    devices; the others are listed last, never compiled and never varied."""
    from loomax.plan import search as search_module
    from loomax.plan.compile import CompileResult
    from loomax.plan.search import Ranked

    compiled = []

    def fake_compile_all(config, topology, candidates, **_):
        compiled.extend(candidates)
        out = []
        for i, c in enumerate(candidates):
            result = CompileResult("local", 8, {}, "cpu", 100, total_bytes=90)
            result.fits, result.est_step_s = True, 1.0 + i
            out.append(Ranked(c, result))
        return out

    monkeypatch.setattr(search_module, "compile_all", fake_compile_all)
    flags = ["--model.seq_len", "32768", "--trainer.train_batch_size", "2"]
    config = parse_config(TrainLmConfig, None, flags)
    eight = types.SimpleNamespace(num_devices=8, num_slices=1, platform="cpu")
    ranked = search(config, eight, max_candidates=24, progress=False)
    skipped = [r for r in ranked if r.skipped]
    assert skipped and ranked[-len(skipped) :] == skipped
    assert all("does not split over its" in r.error and r.result is None for r in skipped)
    assert {data_ways(c) for c in compiled} <= {1, 2}
    assert any(c.label.startswith("fsdp cp4 2x4") for c in compiled)
    table = plan_table(ranked)
    assert "failed: not compiled" not in table and "not compiled: trainer.train_batch_size" in table


def data_ways(candidate) -> int:
    from loomax.plan.candidates import data_parallel_of

    return data_parallel_of(candidate)


def test_a_mixture_of_experts_gets_expert_parallel_strategies():
    labels = [c.label for c in mesh_strategies(8, num_experts=4)]
    assert labels[:4] == ["fsdp 8x1", "fsdp ep2 4x2x1", "fsdp ep4 2x4x1", "dp 8x1"]
    assert "fsdp ep2 tp2 2x2x2" in labels and not any("ep8" in label for label in labels)
    ep4 = next(c for c in mesh_strategies(8, num_experts=4) if c.label == "fsdp ep4 2x4x1")
    assert ep4.apply(parse_config(TrainLmConfig, None, [])).trainer.mesh.resolve(8) == {
        "replica": 1, "data": 2, "expert": 4, "context": 1, "model": 1, "stage": 1,
    }  # fmt: skip
    assert not any("ep" in c.label for c in mesh_strategies(8))  # dense: none
    config = parse_config(
        TrainLmConfig, None, ["--model.type", "mixtral", "--trainer.mesh.expert", "4"]
    )
    assert num_experts_of(config) == 8
    assert run_default(config, 8).label == "fsdp ep4 2x4x1 (the run's)"


def test_overrides_round_trip_through_flags_and_yaml():
    overrides = {
        "trainer.mesh": {"replica": 1, "data": 2, "model": 2},
        "trainer.fsdp_axis": None,
        "trainer.per_device_parallelism": 2,
        "model.gradient_checkpointing": "offload",
        "model.remat_save": ["qkv", "attn_out"],
    }
    base = parse_config(TrainLmConfig, None, [])
    parsed = parse_config(TrainLmConfig, None, as_flags(overrides))
    assert parsed == apply_overrides(base, overrides)
    assert parsed.model.remat_save == ("qkv", "attn_out")
    assert nested(overrides)["trainer"]["mesh"] == {"replica": 1, "data": 2, "model": 2}


def test_remat_variants_include_policies_that_keep_attention():
    config = parse_config(TrainLmConfig, None, [])
    base = mesh_strategies(8)[0]
    variants = {
        c.label.removeprefix(base.label + " "): c.overrides for c in remat_variants(base, config)
    }
    assert set(variants) == {"offload", "no-remat", "remat save-attn", "offload save-attn"}
    saved = variants["offload save-attn"]
    assert saved["model.gradient_checkpointing"] == "offload"
    assert saved["model.remat_save"] == ["qkv", "attn_out", "splash_residuals"]
    assert apply_overrides(config, saved).model.remat_save == (
        "qkv",
        "attn_out",
        "splash_residuals",
    )


def test_remat_variants_of_a_ring_split_keep_the_ring_residuals():
    """Where a candidate splits the sequence (ring attention), the plan also tries keeping
    the ring's output and log-sum-exp (its forward is otherwise rerun in the backward);
    elsewhere it does not."""
    config = parse_config(TrainLmConfig, None, ["--model.seq_len", "32768"])
    split = context_strategies(8, 1, 32768)[0]
    labels = {c.label.removeprefix(split.label + " "): c for c in remat_variants(split, config)}
    assert {"remat save-ring", "offload save-ring"} <= set(labels)
    saved = labels["offload save-ring"].overrides
    assert saved["model.gradient_checkpointing"] == "offload"
    assert saved["model.remat_save"] == ["ring_residuals"]
    unsplit = mesh_strategies(8)[0]
    assert not any("ring" in c.label for c in remat_variants(unsplit, config))


@pytest.mark.slow
def test_plan_ranks_candidates_and_its_overlay_trains(tmp_path, repo_root):
    run = repo_root / "config" / "llama_tiny.yaml"
    args = ["--model.vocab_size", "512", "--model.seq_len", "32", "--trainer.train_batch_size", "4"]
    config = parse_config(TrainLmConfig, str(run), args)
    ranked = search(config, get_topology("local"), max_candidates=4, progress=False)
    assert len(ranked) >= 4
    assert all(r.result is not None for r in ranked), [r.error for r in ranked]
    times = [r.result.est_step_s for r in ranked if r.result.fits is not False]
    assert times == sorted(times)
    table = plan_table(ranked)
    assert all(r.candidate.label in table for r in ranked)
    overlay = tmp_path / "plan-local.yaml"
    overlay.write_text(overlay_yaml(best(ranked), str(run), "local", len(ranked)))
    trained = parse_config(
        TrainLmConfig,
        str(run),
        args + ["--overlay", str(overlay), "--trainer.num_train_steps", "2"],
    )
    expected = apply_overrides(config, best(ranked).candidate.overrides)
    assert trained.model == expected.model
    assert trained.trainer.mesh == expected.trainer.mesh
    assert trained.trainer.fsdp_axis == expected.trainer.fsdp_axis
    assert trained.trainer.per_device_parallelism == expected.trainer.per_device_parallelism
    result = run_benchmark(trained, steps=1, warmup=1)  # 2 steps
    assert result["final_loss"] > 0


@requires_libtpu
@pytest.mark.slow
def test_plan_on_a_tpu_topology_in_child_processes(repo_root, monkeypatch):
    """The CLI path: each candidate compiles in its own process (a compiler crash costs one)."""
    from loomax.plan.search import compile_all

    # the children at libtpu's quick effort (conftest.py's quick_compiles: fits and state
    # bytes do not depend on it), and 8 rows, not the run's 32: a third less compiling
    monkeypatch.setenv("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1")
    run = repo_root / "config" / "llama_tiny.yaml"
    args = ["--config_path", str(run), "--model.vocab_size", "512", "--model.seq_len", "32"]
    args += ["--trainer.train_batch_size", "8"]
    config = parse_config(TrainLmConfig, str(run), args[2:])
    topology = get_topology("v5e:2x2")
    candidates = mesh_strategies(4)[:2]
    ranked = compile_all(config, topology, candidates, config_args=args, progress=False)
    assert [r.result.fits for r in ranked] == [True, True], [r.error for r in ranked]
    assert ranked[1].result.state_bytes > 3 * ranked[0].result.state_bytes  # dp vs fsdp


def test_offload_variants_place_the_optimizer_state_each_other_way():
    config = parse_config(TrainLmConfig, None, [])
    base = mesh_strategies(8)[0]
    variants = {c.label.removeprefix(base.label + " "): c for c in offload_variants(base, config)}
    assert set(variants) == {"offload-opt", "offload-opt host-update", "offload-all host-update"}
    host = variants["offload-opt host-update"].apply(config).trainer
    assert host.offload_optimizer_state and host.offload_optimizer_update
    assert not host.offload_params
    everything = variants["offload-all host-update"].apply(config).trainer
    assert everything.offload_params and everything.offload_optimizer_update
    on_gpus = {
        c.label.removeprefix(base.label + " ") for c in offload_variants(base, config, "gpu")
    }
    assert on_gpus == {"offload-opt"}  # XLA's GPU compiler builds no update on the host
    unrolled = parse_config(TrainLmConfig, None, ["--model.scan_layers", "false"])
    assert "offload-all" not in " ".join(c.label for c in offload_variants(base, unrolled))
    # from a run that offloads, the way back applies too (no update on the host without state)
    offloaded = variants["offload-opt host-update"]
    back = {c.label.rsplit(" ", 1)[-1]: c for c in offload_variants(offloaded, config)}
    assert not back["no-offload"].apply(config).trainer.offload_optimizer_state


@pytest.mark.parametrize("others_fit", [False, True])
def test_plan_tries_offloading_the_best_and_ranks_it_with_the_others(monkeypatch, others_fit):
    """The search's last round: the best candidate with its optimizer state in host memory.
    Ranked with the rest, it comes first where only it fits, and after every candidate that
    fits without it otherwise (XLA's estimate leaves out the host's part)."""
    from loomax.plan import search as search_module
    from loomax.plan.compile import CompileResult
    from loomax.plan.search import Ranked

    def fake_compile_all(config, topology, candidates, **_):
        out = []
        for i, c in enumerate(candidates):
            offloads = bool(c.overrides.get("trainer.offload_optimizer_state"))
            offloads |= bool(c.overrides.get("trainer.offload_params"))
            fits = offloads or others_fit
            result = CompileResult("local", 8, {}, "cpu", 100, total_bytes=90 if fits else 101 + i)
            result.fits, result.est_step_s = fits, (0.5 if offloads else 1.0 + i)
            out.append(Ranked(c, result))
        return out

    monkeypatch.setattr(search_module, "compile_all", fake_compile_all)
    config = parse_config(TrainLmConfig, None, [])
    ranked = search(config, get_topology("local"), max_candidates=24, progress=False)
    labels = [r.candidate.label for r in ranked]
    offloaded = [i for i, label in enumerate(labels) if "offload-" in label]
    assert len(offloaded) == 3 and len(labels) <= 24
    assert all(labels[i].startswith(labels[0].split(" offload-")[0]) for i in offloaded)
    n = len(labels)
    assert offloaded == ([0, 1, 2] if not others_fit else [n - 3, n - 2, n - 1])
