"""Muon against AdamW, per step, on 8 fake CPU devices (FSDP 8; issue 64 item 5).

  python bench/muon.py [--config config/llama_1b.yaml] [--rows 1] [--steps 8] [--out FILE]

Two figures, each for ``adam`` and ``muon`` side by side and as the ratio muon / adam:

* compile only, at the config's shapes (llama_1b: hidden 2048, 16 layers, MLP 8192,
  Llama 3's vocabulary 128256, ``rows`` sequences of 4096 tokens per device): XLA's FLOPs
  per device (its cost analysis counts a scanned layer's body once, the same in both
  programs, so this ratio overstates Muon's share), the plan's matmul count per device
  (every loop at its trips, ``plan/flops.py``: the honest ratio; it counts the global
  jaxpr, divided by the devices, which the split Newton-Schulz matches) and XLA's
  temporaries per device; also Muon with ``split_newton_schulz: false``;
* a CPU timing at a small width (Llama hidden 256, 4 layers, MLP 1024, 128 tokens x
  ``cpu_rows`` rows): the median step time of ``steps`` steps after two untimed ones.

Raw results go to ``--out`` (default ``bench/results/muon_<date>.json``) with the CPU's name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.plan.build import built_step  # noqa: E402
from loomax.plan.flops import count_step  # noqa: E402
from machine import cpu_name  # noqa: E402

OPTIMIZERS = {
    "adam": ["--optimizer.type=adam"],
    "muon": ["--optimizer.type=muon"],
    "muon_not_split": ["--optimizer.type=muon", "--optimizer.split_newton_schulz=false"],
}


def compiled_cost(path: str, rows: int, flags: list[str]) -> dict:
    overrides = [
        f"--trainer.train_batch_size={rows * 8}",
        "--trainer.per_device_parallelism=-1",
        "--trainer.mesh.data=8",
        "--model.vocab_size=128256",
        *flags,
    ]
    config = parse_config(TrainLmConfig, path, overrides)
    start = time.perf_counter()
    with built_step(config, jax.devices()[:8]) as built:
        traced = built.trace()
        count = count_step(traced.jaxpr)
        compiled = traced.lower().compile()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "xla_flops_per_device": float(cost.get("flops", 0.0)),
        "counted_flops_per_device": count.total_flops / 8,
        "temp_bytes_per_device": int(compiled.memory_analysis().temp_size_in_bytes),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def cpu_step_ms(name: str, steps: int, rows: int = 16) -> float:
    """Median step time (ms) of a small Llama on FSDP 8 with optimizer ``name``."""
    from loomax.data import BatchLoader, TokenWindows
    from loomax.lm import lm_loss
    from loomax.mesh import MeshConfig
    from loomax.models import LlamaConfig
    from loomax.optim import AdamConfig, MuonConfig
    from loomax.tracking import NoopTrackerConfig
    from loomax.train import Trainer, TrainerConfig

    model = LlamaConfig(seq_len=128, hidden_dim=256, intermediate_dim=1024, num_layers=4,
                        num_heads=4, num_kv_heads=2, gradient_checkpointing=False)  # fmt: skip
    cls = {"adam": AdamConfig, "muon": MuonConfig}[name]
    optimizer = cls(learning_rate=1e-3, warmup=0, lr_schedule="constant")
    total = steps + 2
    config = TrainerConfig(num_train_steps=total, train_batch_size=rows, mesh=MeshConfig(1, 8, 1),
                           progress_bar=False, tracker=NoopTrackerConfig(),
                           load_checkpoint=False, run_dir=tempfile.mkdtemp())  # fmt: skip
    trainer = Trainer(config, optimizer.build(total), lm_loss(), devices=jax.devices()[:8])
    stamps: list[float] = []
    trainer.add_hook(lambda info: (float(info.loss), stamps.append(time.perf_counter())))
    state = trainer.initial_state(lambda key: model.build(1024, key=key))
    tokens = np.random.default_rng(0).integers(0, 1024, 200_000, dtype=np.int32)
    trainer.train(state, BatchLoader(TokenWindows(tokens, 128), rows, seed=0).iter_from(0))
    trainer.finish()
    return 1000 * statistics.median(np.diff(stamps[1:]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/llama_1b.yaml")
    parser.add_argument("--rows", type=int, default=1, help="sequences per device (compile)")
    parser.add_argument("--steps", type=int, default=8, help="timed CPU steps")
    parser.add_argument("--cpu_rows", type=int, default=16, help="sequences a CPU step")
    parser.add_argument("--skip_compile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cpu = cpu_name()
    results: dict = {"config": args.config, "rows_per_device": args.rows, "cpu": cpu}
    if not args.skip_compile:
        compiled = {}
        for name, flags in OPTIMIZERS.items():
            compiled[name] = compiled_cost(args.config, args.rows, flags)
            print(json.dumps({name: compiled[name]}), flush=True)
        results["compile"] = compiled
        for key in ("xla_flops_per_device", "counted_flops_per_device", "temp_bytes_per_device"):
            ratios = {n: round(compiled[n][key] / compiled["adam"][key], 3) for n in compiled}
            results.setdefault("compile_ratio_to_adam", {})[key] = ratios
            print(f"{key:>26}: / adam: {ratios}", flush=True)
    timed = {
        n: round(float(cpu_step_ms(n, args.steps, args.cpu_rows)), 1) for n in ("adam", "muon")
    }
    results["cpu_rows"] = args.cpu_rows
    results["cpu_step_ms"] = timed
    results["cpu_ratio_muon_to_adam"] = round(timed["muon"] / timed["adam"], 3)
    print(f"CPU step ms ({cpu}, FSDP 8 fake devices, Llama hidden 256, {args.cpu_rows} rows): {timed}, "
          f"muon / adam {results['cpu_ratio_muon_to_adam']}", flush=True)  # fmt: skip
    out = args.out or f"bench/results/muon_{datetime.date.today().isoformat()}.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
