"""Peak memory vs step time for each ``model.gradient_checkpointing`` setting (figures, not tests).

For every setting it jits one training gradient (loss + backward of a Llama or GPT-2),
reads the compiled program's memory analysis (arguments + outputs + temporaries: what
the device must hold at the peak) and times ``--steps`` executions. All settings run in
one process, one after another, so their figures compare side by side.

    .venv/bin/python bench/remat.py [--model llama|gpt2] [--layers 8] [--hidden 256]
        [--seq_len 512] [--batch 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import haliax as hax
import jax
import numpy as np

from loomax.models import Gpt2Config, LlamaConfig, next_token_loss

SETTINGS = [False, True, "nested", "recompute", "save_all", "offload"]


def build_config(args, remat):
    common = dict(
        seq_len=args.seq_len,
        hidden_dim=args.hidden,
        num_layers=args.layers,
        gradient_checkpointing=remat,
    )
    if args.model == "gpt2":
        return Gpt2Config(num_heads=args.hidden // 64, **common)
    return LlamaConfig(num_heads=args.hidden // 64, intermediate_dim=args.hidden * 8 // 3, **common)


def measure(args, remat) -> dict:
    config = build_config(args, remat)
    model = config.build(args.vocab, key=jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq_len), 0, args.vocab)
    tokens = hax.named(ids, ("batch", "position"))

    def grads(model, tokens):
        return jax.grad(lambda m: next_token_loss(m, tokens)[0] / tokens.array.size)(model)

    start = time.perf_counter()
    compiled = jax.jit(grads).lower(model, tokens).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        peak -= getattr(mem, "alias_size_in_bytes", 0)
    jax.block_until_ready(compiled(model, tokens))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(model, tokens))
        times.append(time.perf_counter() - start)
    return {
        "gradient_checkpointing": remat,
        "peak_mib": None if peak is None else round(peak / 2**20, 1),
        "temp_mib": None if mem is None else round(mem.temp_size_in_bytes / 2**20, 1),
        "step_ms_median": round(statistics.median(times) * 1e3, 1),
        "step_ms_min": round(min(times) * 1e3, 1),
        "compile_s": round(compile_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{args.model}: {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, batch {args.batch}, "
        f"vocab {args.vocab}, {jax.default_backend()}"
    )
    print(
        f"{'gradient_checkpointing':<24} {'peak MiB':>9} {'temp MiB':>9} {'step ms':>9} {'min ms':>9} {'compile s':>10}"
    )
    rows = []
    for remat in SETTINGS:
        try:
            row = measure(args, remat)
        except Exception as e:  # e.g. offload without a pinned_host memory space on CPU
            print(
                f"{remat!s:<24} unavailable here: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            )
            continue
        rows.append(row)
        print(
            f"{remat!s:<24} {row['peak_mib']!s:>9} {row['temp_mib']!s:>9} {row['step_ms_median']:>9} "
            f"{row['step_ms_min']:>9} {row['compile_s']:>10}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
