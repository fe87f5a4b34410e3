"""Bytes DiLoCo sends between workers per step, against data parallel (figures, not a test).

Compiles (nothing runs) the train step of a GPT-2 on a mesh of ``replica`` x ``data``
devices, as plain data parallel and as DiLoCo's inner step and sync steps, and reads from
each compiled program the bytes (per device) of the collectives that cross ``replica``
(``loomax.train.collectives``). DiLoCo's average per step is its syncs' bytes over H.

    python bench/diloco.py                                # 8 CPU devices, 2 replicas
    python bench/diloco.py --topology 2xv5p:2x2x1         # TPU programs, via libtpu, on any host

The CPU backend widens bfloat16 all-reduces to float32, so bf16 pseudo-gradients halve the
bytes only in TPU (and GPU) programs.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # TPU topologies compile through libtpu anyway
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import optax  # noqa: E402

from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig, batch_sharding  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.plan.topology import get_topology  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402
from loomax.train.collectives import bytes_across  # noqa: E402
from loomax.train.diloco import DiLoCoConfig  # noqa: E402


def cross_bytes(config: TrainerConfig, model: Gpt2Config, vocab: int, devices, sync) -> int:
    trainer = Trainer(
        config, optax.adamw(1e-3), lm_loss(), run_dir="/tmp/diloco-bench", devices=devices
    )
    state = trainer.abstract_state(lambda key: model.build(vocab, key=key))
    batch = jax.ShapeDtypeStruct(
        (config.train_batch_size, model.seq_len), "int32", sharding=batch_sharding(trainer.mesh)
    )
    compiled = trainer.trace_step(state, batch, sync=sync).lower().compile()
    return bytes_across(compiled.as_text(), trainer.mesh, "replica")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", default="local")
    parser.add_argument("--replica", type=int, default=2)
    parser.add_argument("--inner_steps", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args()
    devices = get_topology(args.topology).devices
    model = Gpt2Config(seq_len=256, hidden_dim=args.hidden, num_layers=args.layers, num_heads=4)
    base = dict(
        num_train_steps=1000, train_batch_size=len(devices), mesh=MeshConfig(args.replica, -1, 1),
        tracker=NoopTrackerConfig(), progress_bar=False,
    )  # fmt: skip
    h = args.inner_steps
    rows = {
        "data parallel": {
            "per step": cross_bytes(TrainerConfig(**base), model, args.vocab, devices, None)
        }
    }
    for fragments, bf16 in ((1, False), (1, True), (4, True)):
        diloco = DiLoCoConfig(inner_steps=h, fragments=fragments, bf16_pseudo_gradients=bf16)
        config = TrainerConfig(**base, diloco=diloco)
        inner = cross_bytes(config, model, args.vocab, devices, None)
        syncs = [cross_bytes(config, model, args.vocab, devices, f) for f in range(fragments)]
        name = f"DiLoCo H={h}, {fragments} fragment(s), {'bf16' if bf16 else 'f32'}"
        rows[name] = {"inner step": inner, "largest sync": max(syncs), "per step": sum(syncs) / h}
    dp = rows["data parallel"]["per step"]
    print(f"{'':45s} {'inner':>10s} {'largest sync':>13s} {'per step':>12s} {'vs DP':>8s}")
    for name, row in rows.items():
        print(
            f"{name:45s} {row.get('inner step', '-'):>10} {row.get('largest sync', '-'):>13} "
            f"{row['per step']:>12.0f} {row['per step'] / dp:>8.4f}"
        )
    print(json.dumps({"topology": args.topology, "devices": len(devices), "rows": rows}))


if __name__ == "__main__":
    main()
