"""A mixture of experts against the dense model with the same active parameters (figures, not tests).

Builds the ``model`` of ``config/mixtral_tiny.yaml`` and of ``config/llama_tiny.yaml`` (the same
attention and width; the MoE's k experts are as wide as the dense MLP), jits one training
gradient of each (loss + backward, f32) on the same random tokens, and times them in
alternation (``--rounds`` rounds of ``--steps`` steps each), so a busy machine slows both
alike. Prints tokens/s of each (median over rounds), their ratio, parameter counts, and
XLA's FLOP estimate of each compiled gradient (labelled: XLA's cost model). Also the
grouped-matmul forms on the MoE: ``--matmul ragged_dot`` shows what XLA:CPU's dense
lowering of ``ragged_dot`` costs.

    .venv/bin/python bench/moe.py [--batch 32] [--steps 5] [--rounds 3] [--matmul blocked]
        [--block 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax

from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.models import next_token_loss

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 4096


def model_config(name: str):
    return parse_config(TrainLmConfig, ROOT / "config" / f"{name}.yaml").model


def gradient(config, batch: int):
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (batch, config.seq_len), 0, VOCAB)
    tokens = hax.named(ids, ("batch", "position"))

    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, t):
        total, count = next_token_loss(
            eqx.combine(p, static), t, block_size=config.cross_entropy_block_size
        )
        return total / count

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    flops = compiled.cost_analysis().get("flops", float("nan"))
    jax.block_until_ready(compiled(params, tokens))  # warm
    return (lambda: jax.block_until_ready(compiled(params, tokens))), flops, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--matmul", default="blocked")
    parser.add_argument(
        "--block", type=int, default=None, help="matmul_block (default: the config's)"
    )
    args = parser.parse_args()
    moe = model_config("mixtral_tiny")
    block = args.block or moe.moe.matmul_block
    moe = dataclasses.replace(
        moe, moe=dataclasses.replace(moe.moe, matmul=args.matmul, matmul_block=block)
    )
    configs = {"mixtral_tiny": moe, "llama_tiny": model_config("llama_tiny")}
    runs = {name: gradient(c, args.batch) for name, c in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (step, _, _) in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    tokens = args.batch * moe.seq_len
    out = {"batch": args.batch, "seq_len": moe.seq_len, "matmul": args.matmul, "block": block}
    for name, (_, flops, model) in runs.items():
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        out[name] = {
            "tokens_per_s": round(tokens / statistics.median(times[name])),
            "params": int(params),
            "xla_flops_estimate_per_step": flops,
            "flops_per_token_formula": configs[name].flops_per_token(VOCAB),
        }
    out["moe_over_dense_tokens_per_s"] = round(
        out["mixtral_tiny"]["tokens_per_s"] / out["llama_tiny"]["tokens_per_s"], 3
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
