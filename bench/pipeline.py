"""Pipeline parallelism on 8 fake CPU devices, compile only (issue 67): per-device work and
memory of the staged step against the one-device program, and each schedule's bubble.

  python bench/pipeline.py [--config config/llama_tiny.yaml] [--out FILE]

Compiles the config's train step (8 layers, 16 sequences a step) on one device, on data 8
(FSDP) and as stage 2 x data 4, stage 4 x data 2 and stage 8, and prints per device: the
plan's matmul count (every loop at its trips, ``plan/flops.py``: the staged loop's idle
slots included), the parameters and optimizer state at rest and XLA's temporaries, each as
a ratio to the one-device program (ideal for 8 devices: 0.125). Then every schedule's
bubble from its table (``loomax/pipeline_schedules.py``) beside its formula. No figure here
is a time. With ``--config config/moe_tiny.yaml --meshes one_device,expert2_data4,
stage2_expert2_data2`` (and ``--trainer.pipeline.schedule=1f1b``), the mixture of experts
with expert parallelism within the stages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.pipeline_schedules import formula, table  # noqa: E402
from loomax.plan.build import built_step  # noqa: E402
from loomax.plan.flops import count_step  # noqa: E402
from machine import cpu_name  # noqa: E402

BATCH = 16
MESHES = {  # name: (devices, mesh, pipeline microbatches)
    "one_device": (1, {"data": 1}, None),
    "data8": (8, {"data": 8}, None),
    "stage2_data4": (8, {"data": 4, "stage": 2}, 4),
    "stage4_data2": (8, {"data": 2, "stage": 4}, 8),
    "stage8": (8, {"data": 1, "stage": 8}, 16),
    # a mixture of experts (--config config/moe_tiny.yaml): expert parallelism without and
    # within stages (add --trainer.pipeline.schedule=1f1b for the explicit loop)
    "expert2_data4": (8, {"data": 4, "expert": 2}, None),
    "stage2_expert2_data2": (8, {"data": 2, "expert": 2, "stage": 2}, 4),
}


def state_bytes(tree) -> int:
    """Bytes of one device's shards of an abstract state (shapes with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        size = 1
        for n in shape:
            size *= n
        total += size * leaf.dtype.itemsize
    return total


def compile_mesh(path: str, devices: int, mesh: dict, micro: int | None, extra: list[str]) -> dict:
    overrides = [
        f"--trainer.train_batch_size={BATCH}",
        "--model.num_layers=8",
        *(f"--trainer.mesh.{k}={v}" for k, v in mesh.items()),
        *([f"--trainer.pipeline.microbatches={micro}"] if micro else []),
        *extra,
    ]
    config = parse_config(TrainLmConfig, path, overrides)
    with built_step(config, jax.devices()[:devices]) as built:
        traced = built.trace()
        count = count_step(traced.jaxpr)
        compiled = traced.lower().compile()
        state = state_bytes(built.state)
    return {
        "devices": devices,
        "mesh": mesh,
        "pipeline_microbatches": micro,
        "counted_flops_per_device": count.total_flops / devices,
        "state_bytes_per_device": state,
        "temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
    }


def bubbles(p: int = 4, m: int = 8) -> dict:
    out = {}
    for name, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
                    ("zero_bubble", 1)):  # fmt: skip
        t = table(name, p, m, v)
        out[name] = {"v": v, "table": round(t.bubble, 4), "formula": round(formula(name, p, m, v), 4),
                     "peak_in_flight": t.peak_in_flight}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/llama_tiny.yaml")
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args(argv)
    results = {}
    for name in args.meshes.split(","):
        devices, mesh, micro = MESHES[name]
        results[name] = compile_mesh(args.config, devices, mesh, micro, extra)
        print(json.dumps({name: results[name]}), flush=True)
    base = results.get("one_device")
    keys = ("counted_flops_per_device", "state_bytes_per_device", "temp_bytes_per_device")
    if base:
        for name, r in results.items():
            r["ratio_to_one_device"] = {
                k: round(r[k] / base[k], 3) if base[k] else None for k in keys
            }
            print(f"{name:>13}: per device vs one device: {r['ratio_to_one_device']}", flush=True)
    table_bubbles = bubbles()
    for name, b in table_bubbles.items():
        print(f"{name:>17} (p 4, m 8, v {b['v']}): bubble {b['table']:.1%} (formula "
              f"{b['formula']:.1%}), peak microbatches held {b['peak_in_flight']}")  # fmt: skip
    out = {"config": args.config, "overrides": extra, "cpu": cpu_name(), "results": results}
    out["bubbles"] = table_bubbles
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
