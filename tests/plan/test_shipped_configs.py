"""Every shipped run config compiles for a TPU topology, with no flag beyond the topology.

Run configs are ``config/*.yaml`` and ``config/bench/*.yaml``; ``config/data`` and
``config/optimizer`` hold ``!include`` pieces and ``config/ladder`` ladder specs (whose
runs are ``quickstart.yaml`` resized). Each config is read as shipped (its vocabulary size
known without a flag or a download), then compiled with its own model type, attention
backend, remat policy, precision, loss, document masks and hooks, at a size that compiles in
seconds: two layers, one sequence per chip, at most 128 positions (one splash block: ``auto``
still picks splash), a vocabulary of 4096, a residual stream of at most 256 (a latent
attention's ranks 128 and 64, experts 256 wide) and at most 16 experts (libtpu takes minutes
for the full widths; bench/README.md has those figures).

Nearly all of this file's CPU is libtpu compiling (AMD EPYC, loaded: DeepSeek-V3's shrunk
step 38.4 of 44.4 CPU-s, the trace 2.6, lowering 1.0, the estimate with the program's text
1.4; quickstart's 3.9 of 5.6); each distinct program is compiled once, and nothing else
(no init, no eval). What a compile costs follows the program's structure (its ops, its
Pallas kernels: splash, megablox) more than its shapes: 512 positions and the full latent
and expert widths cost DeepSeek-V3 43.2 against 33.0 CPU-s, Kimi K2 32.5 against 20.1, the
whole file 286.8 against 249.9 CPU-s (fresh compilation cache); the tiny configs (at most
128 positions, 256 wide) compile as shipped and hold half of it.

``llama_8b.yaml`` (offload, splash, document mask, FSDP) is the case Haliax's own offload
policy broke: it also offloads each layer's slice of the sharded parameters, and libtpu's
compiler aborts on it (async_slice_util.cc: "Sublane slicing size not multiple of update
chunk sublane size"); Loomax's ``offload`` moves the layer inputs only.

These compiles run at XLA's lowest execution-time optimization effort
(``jax_exec_time_optimization_effort`` -1, tests/plan/conftest.py's ``quick_compiles``): libtpu then
skips optimizations that only make the program run faster, and compiles in about half the
CPU time (DeepSeek-V3's shrunk step: 52.6 against 29.9 CPU-s, AMD EPYC). What the tests
check (each config builds, partitions, compiles, fits and gets an estimate) does not depend on
them; its temporaries come out ~4% smaller. XLA's other compile-time knobs
(``jax_optimization_level`` O0, ``jax_memory_fitting_level`` O0,
``jax_memory_fitting_effort`` -1, ``jax_disable_most_optimizations``) save nothing more
(llama_8b's step 6.7 against 6.1-6.6 CPU-s). ``loomax compile`` itself, and the figures in
bench/README.md, use the default effort.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("libtpu", "quick_compiles")  # libtpu: fails, not skips

from loomax.config import parse_config, to_yaml  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.plan.build import vocab_size_of  # noqa: E402
from loomax.plan.compile import compile_run  # noqa: E402
from loomax.plan.rl import compile_rl, is_rl_config, rl_vocab_size  # noqa: E402
from loomax.plan.topology import get_topology  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOT_PLANNED = {
    "dpo_tiny.yaml": "a `loomax dpo` run: `loomax compile` plans the language-model step only; "
    "the DPO step (chosen and rejected rows, the cached reference) is not planned yet",
}
"""Shipped configs of other tasks than ``loomax train``'s, each with why it is not compiled
here (tests/models/test_configs.py parses each as its own task's config)."""
_SHIPPED = sorted(
    name
    for p in [*REPO.glob("config/*.yaml"), *REPO.glob("config/bench/*.yaml")]
    if (name := p.relative_to(REPO / "config").as_posix()) not in NOT_PLANNED
)
RL_CONFIGS = [name for name in _SHIPPED if is_rl_config(str(REPO / "config" / name))]
"""``loomax rl`` runs: compiled through ``plan.rl`` (the rollout and the GRPO update)."""
COMPILED_ELSEWHERE = {"rl_tiny.yaml": "tests/plan/test_rl.py compiles it, through `loomax compile`"}
RUN_CONFIGS = [name for name in _SHIPPED if name not in RL_CONFIGS]
TOPOLOGY = "v5p:2x2x1"
topology = functools.cache(get_topology)  # libtpu makes the devices once per process
_COMPILED: dict[str, object] = {}
"""Compile results by the shrunk config's YAML: configs that differ only in what ``small``
overrides (llama_8b_128k and llama_8b_1m: the sequence, the pod) are one program here."""


SEQ = 128
"""Positions of a shrunk run: still a whole splash block (``auto`` picks splash on TPU)."""


def small(config: TrainLmConfig) -> list[str]:
    """Flags that shrink ``config`` to a quick compile and keep its structure."""
    model = config.model
    flags = ["--model.num_layers", "2", "--trainer.train_batch_size", "4"]
    flags += ["--model.vocab_size", "4096"]  # its own is checked as shipped (vocab_size_of)
    flags += ["--model.seq_len", str(min(model.seq_len, SEQ))]
    moe = getattr(model, "moe", None)
    if model.hidden_dim > 256:
        flags += ["--model.hidden_dim", "256", "--model.num_heads", "4"]
        if hasattr(model, "intermediate_dim"):
            flags += ["--model.intermediate_dim", "512", "--model.head_dim", "64"]
        if getattr(model, "num_kv_heads", None):
            flags += ["--model.num_kv_heads", "2"]
        if getattr(model, "kv_lora_rank", None):  # DeepSeek-V3's latent attention, narrowed
            flags += ["--model.q_lora_rank", "128", "--model.kv_lora_rank", "64"]
        if moe is not None and (moe.expert_intermediate_dim or 0) > 256:
            flags += ["--model.moe.expert_intermediate_dim", "256"]
    if moe is not None and moe.num_experts > 16:  # OLMoE's 64: compiles 3x slower, same code
        flags += ["--model.moe.num_experts", "16"]
    if moe is not None and moe.first_dense_layers > 1:  # DeepSeek-V3's 3: one dense, one routed
        flags += ["--model.moe.first_dense_layers", "1"]
    for axis in ("context", "expert"):  # a long-context or MoE run's split kept, on 4 chips
        if getattr(config.trainer.mesh, axis) > 2:
            flags += [f"--trainer.mesh.{axis}", "2"]
    if config.trainer.mesh.stage > 1:  # a staged run: 2 stages of 1 layer, 2 microbatches
        flags += ["--trainer.mesh.stage", "2", "--trainer.pipeline.microbatches", "2"]
    return flags


def test_the_run_configs_are_found():
    assert {"llama_8b.yaml", "llama_1b.yaml", "quickstart.yaml", "bench/gpt2_tiny.yaml"} <= set(
        RUN_CONFIGS
    )
    assert {"rl_tiny.yaml", "rl_1b.yaml"} <= set(RL_CONFIGS)


def small_rl(config) -> list[str]:
    """Flags that shrink an RL run to a quick compile: ``small``'s, at most 64 positions and
    16 new tokens (a tiny config is compiled as shipped)."""
    if config.model.hidden_dim <= 256 and config.model.seq_len <= 64:
        return []
    flags = small(config)  # its --model.seq_len overridden: the last flag wins
    return flags + ["--model.seq_len", "64", "--rl.max_new_tokens", "16"]


@pytest.mark.parametrize("name", [n for n in RL_CONFIGS if n not in COMPILED_ELSEWHERE])
def test_shipped_rl_config_compiles_both_programs(name):
    """An RL run's rollout and GRPO update compile for the topology, each with its memory."""
    from loomax.rl.command import rl_config

    path = str(REPO / "config" / name)
    config = rl_config(path, [])
    rl_vocab_size(config)  # known without a flag
    result = compile_rl(rl_config(path, small_rl(config)), topology(TOPOLOGY))
    for program in (result.rollout, result.update):
        assert program.error is None and program.fits, (program.error, program.notes)
        assert program.total_bytes > program.temp_bytes > 0
        assert program.mesh["data"] == 4
    assert result.fits


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_shipped_config_compiles_with_no_extra_flag(name):
    path = str(REPO / "config" / name)
    config = parse_config(TrainLmConfig, path, [])
    vocab_size_of(config)  # no model.vocab_size needed: a known tokenizer or the trained BPE
    pods = {
        "llama_8b_128k.yaml": 64, "llama_8b_1m.yaml": 256, "mixtral_8x7b.yaml": 128,
        "llama_70b.yaml": 128, "deepseek_v3_671b.yaml": 2048, "kimi_k2_1t.yaml": 2048,
    }  # fmt: skip
    chips = pods.get(name, 4)
    config.trainer.mesh.resolve(chips)
    shrunk = parse_config(TrainLmConfig, path, small(config))
    key = to_yaml(shrunk)
    if key not in _COMPILED:
        _COMPILED[key] = compile_run(shrunk, topology(TOPOLOGY))
    result = _COMPILED[key]
    assert result.error is None and result.fits, (result.error, result.notes)
    assert result.est_mfu is not None and 0 < result.est_mfu <= 1
    assert math.isfinite(result.est_step_s)
    if config.trainer.mesh.stage > 1:  # 2 stages, 2 microbatches: a loop of 3 slots, 2 busy
        assert result.pipeline["schedule"] == config.trainer.pipeline.schedule
        assert (result.pipeline["slots"], result.pipeline["busy"]) == (3, 2)
        assert result.pipeline["counted"] == result.pipeline["formula"] == 1 / 3
    if config.model.gradient_checkpointing == "offload":
        assert result.host_bytes > 0  # the layer inputs wait in host memory
