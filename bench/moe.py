"""A mixture of experts against the dense model with the same active parameters (figures, not tests).

Issue 48's goal, side by side in one run: ``config/moe_tiny.yaml`` (``--moe``) and
``config/llama_tiny.yaml`` (the same attention and width; the MoE's k experts together as
wide as the dense MLP) are each trained for ``--train-steps`` steps on the embedded corpus
(their own configs otherwise: data, optimizer, seed) and evaluated on the held-out
documents; the two bits per byte are printed together (``--train-steps 0`` skips this).
Then it builds both models, jits one training
gradient of each (loss + backward, f32) on the same random tokens, and times them in
alternation (``--rounds`` rounds of ``--steps`` steps each), so a busy machine slows both
alike. Prints tokens/s of each (median over rounds), their ratio, parameter counts, and
XLA's FLOP estimate of each compiled gradient (labelled: XLA's cost model). Also the
grouped-matmul forms on the MoE: ``--matmul ragged_dot`` shows what XLA:CPU's dense
lowering of ``ragged_dot`` costs.

    .venv/bin/python bench/moe.py [--train-steps 350] [--moe moe_tiny] [--batch 32]
        [--steps 5] [--rounds 3] [--matmul blocked] [--block N]
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
from loomax.train_lm import train_lm

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 4096


def model_config(name: str):
    return parse_config(TrainLmConfig, ROOT / "config" / f"{name}.yaml").model


def held_out_bpb(name: str, steps: int, run_dir: Path) -> float:
    """``config/<name>.yaml`` trained ``steps`` steps; its held-out bits per byte at the end."""
    flags = {
        "trainer.num_train_steps": steps,
        "trainer.steps_per_eval": steps,
        "trainer.max_train_time": "10h",
        "trainer.run_dir": str(run_dir / name),
        "trainer.progress_bar": "false",
        "sample.enabled": "false",
    }
    args = [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    result = train_lm(parse_config(TrainLmConfig, ROOT / "config" / f"{name}.yaml", args))
    step, metrics = result.evals[-1]
    assert step == steps, (step, steps)
    return metrics["eval/bpb"]


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
    parser.add_argument("--train-steps", type=int, default=350)
    parser.add_argument("--moe", default="moe_tiny", help="the MoE config (config/<name>.yaml)")
    parser.add_argument("--run-dir", default="/tmp/loomax_bench_moe")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--matmul", default="blocked")
    parser.add_argument(
        "--block", type=int, default=None, help="matmul_block (default: the config's)"
    )
    args = parser.parse_args()
    names = (args.moe, "llama_tiny")
    bpb = {}
    if args.train_steps:
        bpb = {n: held_out_bpb(n, args.train_steps, Path(args.run_dir)) for n in names}
    moe = model_config(args.moe)
    block = args.block or moe.moe.matmul_block
    moe = dataclasses.replace(
        moe, moe=dataclasses.replace(moe.moe, matmul=args.matmul, matmul_block=block)
    )
    configs = {args.moe: moe, "llama_tiny": model_config("llama_tiny")}
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
        if bpb:
            out[name]["held_out_bpb"] = round(bpb[name], 4)
    if bpb:
        out["train_steps"] = args.train_steps
        out["held_out_bpb"] = {n: round(bpb[n], 4) for n in names}
    out["moe_over_dense_tokens_per_s"] = round(
        out[args.moe]["tokens_per_s"] / out["llama_tiny"]["tokens_per_s"], 3
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
