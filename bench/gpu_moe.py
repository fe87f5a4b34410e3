"""bench/gpu.py's ``moe`` section: the routed MLP on the GPU's grouped matmul.

A Mixtral-shaped model (``config/mixtral_tiny.yaml`` widened: 8 layers of width 1024, 8
experts of 1408, top 2, 2,048 positions) and the dense Llama with the same active MLP width
(2 x 1408), one jitted bf16 training gradient each, timed in alternation. The MoE runs
twice: ``model.moe.matmul`` ``ragged_dot`` (which JAX 0.10's XLA:GPU expands to a dense
product over every expert in the compile-only HLO: the run shows whether the device's JAX
does too) and ``blocked`` (what ``auto`` picks on a GPU and CPU). For each: tokens/s, the active-parameter TFLOP/s (the MFU count: k experts
and the router, causal attention as half), and XLA's FLOP estimate of the compiled gradient
over that count. A grouped matmul expanded to a dense matmul over all experts would show as
a ratio near E/k = 4 on the MLP, not near 1 (labelled: XLA's cost model).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from gpu_checks import REPO

VOCAB = 32000
FULL = {"hidden_dim": 1024, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "seq_len": 2048}
EXPERT_WIDTH = 1408


def _configs(smoke: bool):
    from loomax.config import parse_config
    from loomax.lm import TrainLmConfig

    def load(name):
        return parse_config(TrainLmConfig, REPO / "config" / f"{name}.yaml").model

    moe, dense = load("mixtral_tiny"), load("llama_tiny")
    if smoke:
        return moe, dense, 2
    k = moe.moe.num_experts_per_tok
    moe = dataclasses.replace(moe, **FULL, intermediate_dim=EXPERT_WIDTH)
    dense = dataclasses.replace(dense, **FULL, intermediate_dim=k * EXPERT_WIDTH)
    return moe, dense, 8


def _gradient(config, batch: int):
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp

    from loomax.models import next_token_loss

    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    ids = jax.random.randint(jax.random.PRNGKey(1), (batch, config.seq_len), 0, VOCAB)
    tokens = hax.named(ids, ("batch", "position"))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, t):
        total, count = next_token_loss(eqx.combine(p, static), t, block_size=4096)
        return total / count

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
    jax.block_until_ready(compiled(params, tokens))
    return (lambda: jax.block_until_ready(compiled(params, tokens))), flops


def section_moe(args) -> dict:
    moe, dense, batch = _configs(args.smoke)
    runs = {
        "moe-ragged_dot": dataclasses.replace(
            moe, moe=dataclasses.replace(moe.moe, matmul="ragged_dot")
        ),
        "moe-blocked": dataclasses.replace(
            moe, moe=dataclasses.replace(moe.moe, matmul="blocked", matmul_block=256)
        ),
        "dense-same-active": dense,
    }
    steps = {name: _gradient(config, batch) for name, config in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for name, (step, _) in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    tokens = batch * moe.seq_len
    out: dict = {"batch": batch, "seq_len": moe.seq_len, "vocab": VOCAB, "dtype": "bfloat16"}
    for name, config in runs.items():
        seconds = statistics.median(times[name])
        active = 3 * config.flops_per_token(VOCAB) * tokens
        out[name] = {
            "tokens_per_s": round(tokens / seconds),
            "active_tflops_per_s": round(active / seconds / 1e12, 2),
            "xla_flops_estimate_over_active": round(steps[name][1] / active, 3),
        }
    out["ragged_over_dense_tokens_per_s"] = round(
        out["moe-ragged_dot"]["tokens_per_s"] / out["dense-same-active"]["tokens_per_s"], 3
    )
    return out
