"""Weak scaling of the MoE train step on 8 fake CPU devices (compile only; issue 59).

  python bench/moe_scaling.py [--config config/moe_tiny.yaml] [--rows 2]

Compiles the config's train step three times with the same rows per device: on one device
(``rows`` sequences), on data 8 (8 x ``rows``, no expert axis) and on expert 8 (8 x ``rows``,
one expert group a device; dropless, and with ``model.moe.receive_buffer: 1.25``), and
prints per device: XLA's FLOPs (its cost analysis; a loop
body counted once, the same in every program here), the plan's matmul count (every loop at
its expected trips, ``plan/flops.py``) and XLA's temporaries, each as a ratio to the
one-device program. Weak scaling holds when the ratios stay near 1. Compile-only: no figure
here is a time. Prints one JSON line per mesh, the ratios, and last all of it as one JSON
line (what tests/models/moe/test_moe_scaling.py reads); ``--out FILE`` saves them.
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
from loomax.plan.build import built_step  # noqa: E402
from loomax.plan.flops import count_step  # noqa: E402
from machine import cpu_name  # noqa: E402

MESHES = {  # name: (devices, mesh overrides, other flags)
    "one_device": (1, {}, []),
    "data8": (8, {"data": 8}, []),
    "expert8": (8, {"data": 1, "expert": 8}, []),
    # the receive buffer bounded at 1.25 x the mean routed rows (rows past it dropped)
    "expert8_buffer1.25": (8, {"data": 1, "expert": 8}, ["--model.moe.receive_buffer=1.25"]),
}


def compile_mesh(path: str, rows: int, devices: int, mesh: dict, extra: list[str]) -> dict:
    overrides = [
        f"--trainer.train_batch_size={rows * devices}",
        "--trainer.per_device_parallelism=-1",
        *(f"--trainer.mesh.{k}={v}" for k, v in mesh.items()),
        *extra,
    ]
    config = parse_config(TrainLmConfig, path, overrides)
    with built_step(config, jax.devices()[:devices]) as built:
        traced = built.trace()
        count = count_step(traced.jaxpr)
        compiled = traced.lower().compile()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "devices": devices,
        "mesh": mesh,
        "rows_per_device": rows,
        "xla_flops_per_device": float(cost.get("flops", 0.0)),
        "counted_flops_per_device": count.total_flops / devices,
        "temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/moe_tiny.yaml")
    parser.add_argument("--rows", type=int, default=2, help="sequences per device")
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="extra --section.key=value flags")
    args, unknown = parser.parse_known_args(argv)
    args.overrides += unknown
    results = {}
    for name in args.meshes.split(","):
        devices, mesh, flags = MESHES[name]
        results[name] = compile_mesh(
            args.config, args.rows, devices, mesh, [*flags, *args.overrides]
        )
        print(json.dumps({name: results[name]}), flush=True)
    base = results.get("one_device")
    if base:
        for name, r in results.items():
            ratios = {
                key: round(r[key] / base[key], 3) if base[key] else None
                for key in (
                    "xla_flops_per_device",
                    "counted_flops_per_device",
                    "temp_bytes_per_device",
                )
            }
            r["ratio_to_one_device"] = ratios
            print(f"{name:>10}: per device vs one device: {ratios}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "cpu": cpu_name(), "results": results}, f, indent=1)
    print(json.dumps(results))  # last line: what a test reads
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
