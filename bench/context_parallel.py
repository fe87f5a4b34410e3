"""Context parallelism on fake CPU devices: attention memory per device, and train-step
tokens/s of a tiny Llama, for no split, ring and all-gather (figures, not tests).

Memory is XLA's account of the compiled program per device (``memory_analysis``: its
temporaries, and in "total" also the arguments and outputs each device holds). The fake
devices share this machine's cores, so tokens/s compares the variants' work and collectives
on one host, not the speed of real devices. ``--no-split-estimate`` does not run the unsplit
step (it may not fit): its memory is then the compiled program's account, and it prints no
tokens/s. ``--json PATH`` writes the rows.

.venv/bin/python bench/context_parallel.py [--seq 8192] [--context 4] [--steps 3]
    [--warmup 1] [--cases 'no split,ring,all_gather']
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

from loomax.lm.loss import lm_loss_for  # noqa: E402
from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

CASES = (("no split", 1, "ring"), ("ring", None, "ring"), ("all_gather", None, "all_gather"))
HEADS, KV_HEADS, HEAD_SIZE, EOS = 8, 2, 64, 0


def runtime(context: int) -> MeshRuntime:
    mesh = MeshConfig(data=1, context=context).build(jax.devices()[:context])
    return MeshRuntime(mesh, make_axis_mappings())


def attention_memory(seq: int, context: int, variant: str) -> tuple[float, float]:
    """Forward + backward of one causal attention (8 query heads, 2 KV heads of 64, documents,
    the default blocks), compiled only: ``(temporary MiB, total MiB)`` per device, the total
    with the arguments and outputs (the tests' ``attention_bytes``)."""
    spec = importlib.util.spec_from_file_location(
        "context_parallel_run",
        Path(__file__).parents[1] / "tests/models/attention/context_parallel_run.py",
    )
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    got = run.attention_bytes(
        context, variant, seq=seq, heads=HEADS, kv_heads=KV_HEADS, size=HEAD_SIZE, flash_block=None
    )
    return got["temp"] / 2**20, got["total"] / 2**20


def step_speed(
    seq: int, context: int, variant: str, steps: int, run: bool = True, width: int = 64,
    layers: int = 2, warmup: int = 1,
) -> tuple[float | None, float, float]:  # fmt: skip
    """A Llama's (tiny by default: ``width`` 64, 4 heads, 2 layers) loss and gradients on one
    row of ``seq`` tokens (documents at EOS): ``(tokens/s, temporary MiB, total MiB per
    device)``; tokens/s None unless ``run``. ``warmup`` untimed executions of the compiled
    step come first (0 for long sequences: nothing is left to compile by then)."""
    rt = runtime(context)
    config = LlamaConfig(
        seq_len=seq, hidden_dim=width, intermediate_dim=2 * width, num_layers=layers, num_heads=4,
        num_kv_heads=2, context_parallel=variant, attn_backend="blockwise",
    )  # fmt: skip
    model = config.build(256, key=jax.random.PRNGKey(0))
    tokens = rt.shard_batch(jax.random.randint(jax.random.PRNGKey(1), (1, seq), 0, 256))
    loss_fn = lm_loss_for(config, eos_id=EOS)

    def mean_loss(model, tokens):
        (total, weight), _ = loss_fn(model, tokens)
        return total / weight

    def step(model, tokens):
        return jax.grad(mean_loss)(model, tokens)

    with rt.mesh_context():
        compiled = jax.jit(step).lower(model, tokens).compile()
        stats = compiled.memory_analysis()
        temp = stats.temp_size_in_bytes / 2**20
        total = temp + (stats.argument_size_in_bytes + stats.output_size_in_bytes) / 2**20
        if not run:
            return None, temp, total
        for _ in range(warmup):
            jax.block_until_ready(compiled(model, tokens))
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(compiled(model, tokens))
    seconds = (time.perf_counter() - start) / steps
    return seq / seconds, temp, total


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: its arguments; None: ``sys.argv``'s)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--context", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-split-estimate", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--width", type=int, default=64, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-only", action="store_true", help="compile; run no step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed")
    parser.add_argument(
        "--cases", default=",".join(c[0] for c in CASES), help="comma-separated subset of cases"
    )
    args = parser.parse_args(argv)
    chosen = args.cases.split(",")
    unknown = sorted(set(chosen) - {c[0] for c in CASES})
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {[c[0] for c in CASES]}")
    print(f"sequence {args.seq}, context {args.context} ({DEVICES} fake CPU devices)")
    heads = ("attn temp MiB", "attn total MiB", "step tok/s", "step temp MiB", "step total MiB")
    print(f"{'':12} " + " ".join(f"{h:>14}" for h in heads))
    rows = []
    for name, context, variant in CASES:
        if name not in chosen:
            continue
        context = context or args.context
        temp, total = attention_memory(args.seq, context, variant)
        run = not (args.memory_only or (context == 1 and args.no_split_estimate))
        speed, step_temp, step_total = step_speed(
            args.seq, context, variant, args.steps, run, args.width, args.layers, args.warmup
        )
        shown = f"{speed:14.0f}" if speed is not None else f"{'(not run)':>14}"
        print(f"{name:12} {temp:14.1f} {total:14.1f} {shown} {step_temp:14.1f} {step_total:14.1f}")
        rows.append({
            "case": name, "context": context, "attention_temp_mib": round(temp, 2),
            "attention_total_mib": round(total, 2), "step_tokens_per_s": speed,
            "step_temp_mib": round(step_temp, 2), "step_total_mib": round(step_total, 2),
            "memory": "XLA memory_analysis of the compiled program, per device",
        })  # fmt: skip
    if args.json:
        meta = {"seq": args.seq, "context": args.context, "devices": DEVICES, "steps": args.steps,
                "warmup": args.warmup, "width": args.width, "layers": args.layers}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
