"""Sharding benchmarks (figures, not tests).

1. Throughput of the quickstart model on 1 vs 2 CPU devices (``loomax bench`` in
   subprocesses with ``--xla_force_host_platform_device_count``).
2. Peak host memory per process with FSDP vs replicated parameters: N single-device
   processes joined by ``jax.distributed`` on 127.0.0.1 create the state of a ~100M
   parameter GPT-2 and take one step. With FSDP, parameters and Adam moments per process
   should drop roughly by the data axis size (N).

    python bench/sharding.py [--processes 4] [--skip-throughput] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOMAX = REPO / ".venv" / "bin" / "loomax"
PYTHON = REPO / ".venv" / "bin" / "python"


def throughput(devices: int, steps: int) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }
    cmd = [
        str(LOOMAX),
        "bench",
        "--config_path",
        "config/quickstart.yaml",
        "--model.vocab_size",
        "4096",
        "--steps",
        str(steps),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_worker(process_id: int, count: int, port: int, fsdp: bool) -> None:
    """One process of the memory benchmark: init sharded state, one step, report peak RSS."""
    import numpy as np

    from loomax.distributed import DistributedConfig
    from loomax.lm import lm_loss
    from loomax.models import Gpt2Config
    from loomax.optim import AdamConfig
    from loomax.tracking import NoopTrackerConfig
    from loomax.train import Trainer, TrainerConfig, setup_process

    model = Gpt2Config(
        seq_len=64, hidden_dim=1024, num_layers=6, num_heads=8, gradient_checkpointing=True
    )
    vocab = 32768
    config = TrainerConfig(
        num_train_steps=1,
        train_batch_size=count,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        fsdp_axis="embed" if fsdp else None,
        distributed=DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=process_id
        ),
    )
    trainer = Trainer(config, AdamConfig().build(1), lm_loss(), run_id=setup_process(config))
    state = trainer.initial_state(lambda key: model.build(vocab, key=key))
    batch = np.random.default_rng(process_id).integers(0, vocab, (1, model.seq_len), dtype=np.int32)
    state, metrics = trainer.train_step(state, batch)
    float(metrics["train/loss"])
    local_bytes = sum(
        s.data.nbytes
        for leaf in __import__("jax").tree.leaves(state)
        for s in getattr(leaf, "addressable_shards", [])
    )
    print(
        json.dumps(
            {
                "process": process_id,
                "fsdp": fsdp,
                "params": model.param_count(vocab),
                "state_bytes_on_process": local_bytes,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def memory(count: int, fsdp: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }
    procs = [
        subprocess.Popen(
            [str(PYTHON), __file__, "--worker", str(i), str(count), str(port), str(int(fsdp))],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        memory_worker(args.worker[0], args.worker[1], args.worker[2], bool(args.worker[3]))
        return
    report = {}
    if not args.skip_throughput:
        one, two = throughput(1, args.steps), throughput(2, args.steps)
        print(
            f"quickstart model, tokens/s: 1 device {one['tokens_per_second']:.0f}, 2 devices {two['tokens_per_second']:.0f} "
            f"(ratio {two['tokens_per_second'] / one['tokens_per_second']:.2f})"
        )
        report["throughput"] = {
            "1_device": one["tokens_per_second"],
            "2_devices": two["tokens_per_second"],
        }
    if not args.skip_memory:
        rows = {}
        for fsdp in (False, True):
            runs = memory(args.processes, fsdp)
            rows["fsdp" if fsdp else "replicated"] = {
                "peak_rss_mb": max(r["peak_rss_bytes"] for r in runs) / 2**20,
                "state_mb_per_process": max(r["state_bytes_on_process"] for r in runs) / 2**20,
                "params": runs[0]["params"],
            }
        rep, fs = rows["replicated"], rows["fsdp"]
        print(
            f"{args.processes} processes x 1 CPU device, GPT-2 {rep['params'] / 1e6:.0f}M params, after init + 1 step:"
        )
        print(f"  {'':12} {'state MB/process':>18} {'peak RSS MB/process':>22}")
        for name, row in rows.items():
            print(f"  {name:12} {row['state_mb_per_process']:18.0f} {row['peak_rss_mb']:22.0f}")
        print(
            f"  state ratio replicated/fsdp: {rep['state_mb_per_process'] / fs['state_mb_per_process']:.2f} "
            f"(data axis {args.processes}); peak RSS ratio: {rep['peak_rss_mb'] / fs['peak_rss_mb']:.2f}"
        )
        report["memory"] = rows
    print(json.dumps(report))


if __name__ == "__main__":
    main()
