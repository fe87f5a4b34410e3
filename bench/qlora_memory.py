"""QLoRA's memory per device against a bf16 base, compile only (issue 63, QLoRA).

  python bench/qlora_memory.py [--config config/llama_1b.yaml] [--rows 1] [--out FILE]

A LoRA run (the default adapters: rank 8 on every attention and MLP projection) of the
config's model, its train step compiled for 8 fake CPU devices (FSDP: mesh data 8; ``rows``
sequences of the config's length per device, Llama 3's vocabulary 128256), with the frozen
base of the adapted layers stored as:

* ``bf16``: the whole model in bfloat16 (``trainer.mp p=bfloat16,c=bfloat16``);
* ``f32``: the config's policy (parameters float32, compute bfloat16);
* ``int8`` / ``nf4``: ``model.lora.quantize_base`` (codes and float32 scales, blocks of 64;
  the rest float32, compute bfloat16).

Printed side by side, per device: XLA's argument bytes (the state and the batch: what the
step keeps between steps), its temporaries, and the adapted layers' base weights as stored
(from the abstract state, divided by the 8 devices they are split over), with each ratio to
``bf16``. Raw results go to ``--out`` (default ``bench/results/qlora_memory_<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.models.lora.linear import adapter_layers  # noqa: E402
from loomax.plan.build import built_step  # noqa: E402

VARIANTS = {
    "bf16": ["--trainer.mp=p=bfloat16,c=bfloat16"],
    "f32": [],
    "int8": ["--model.lora.quantize_base=int8"],
    "nf4": ["--model.lora.quantize_base=nf4"],
}


def base_bytes(model) -> int:
    """Bytes of the adapted layers' frozen base weights as stored (codes and scales, or the weight)."""
    total = 0
    for layer in adapter_layers(model).values():
        parts = (
            (layer.weight,)
            if layer.quantized is None
            else (layer.quantized.codes, layer.quantized.scales)
        )
        total += sum(p.array.size * p.array.dtype.itemsize for p in parts)
    return total


def compiled_memory(path: str, rows: int, flags: list[str]) -> dict:
    overrides = [
        f"--trainer.train_batch_size={rows * 8}",
        "--trainer.per_device_parallelism=-1",
        "--trainer.mesh.data=8",
        "--model.vocab_size=128256",
        "--model.lora.rank=8",
        *flags,
    ]
    config = parse_config(TrainLmConfig, path, overrides)
    start = time.perf_counter()
    with built_step(config, jax.devices()[:8]) as built:
        base = base_bytes(built.state.model)
        compiled = built.trace().lower().compile()
    memory = compiled.memory_analysis()
    return {
        "argument_bytes_per_device": int(memory.argument_size_in_bytes),
        "temp_bytes_per_device": int(memory.temp_size_in_bytes),
        "base_bytes_per_device": base // 8,
        "compile_s": round(time.perf_counter() - start, 1),
    }


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/llama_1b.yaml")
    parser.add_argument("--rows", type=int, default=1, help="sequences per device")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results: dict = {"config": args.config, "rows_per_device": args.rows, "cpu": cpu_name()}
    measured = {}
    for name, flags in VARIANTS.items():
        measured[name] = compiled_memory(args.config, args.rows, flags)
        print(json.dumps({name: measured[name]}), flush=True)
    results["compile"] = measured
    for key in ("argument_bytes_per_device", "temp_bytes_per_device", "base_bytes_per_device"):
        gib = {n: round(measured[n][key] / 2**30, 3) for n in measured}
        ratios = {n: round(measured[n][key] / measured["bf16"][key], 3) for n in measured}
        results.setdefault("ratio_to_bf16", {})[key] = ratios
        print(f"{key:>26} GiB: {gib}  / bf16: {ratios}", flush=True)
    out = args.out or f"bench/results/qlora_memory_{datetime.date.today().isoformat()}.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
