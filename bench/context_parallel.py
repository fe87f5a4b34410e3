"""Context parallelism on fake CPU devices: attention memory per device, and train-step
tokens/s of a tiny Llama, for no split, ring and all-gather (figures, not tests).

Memory is XLA's account of the compiled program per device (``memory_analysis``: its
temporaries, and the arguments each device holds). The fake devices share this machine's
cores, so tokens/s compares the variants' work and collectives on one host, not the speed
of real devices.

.venv/bin/python bench/context_parallel.py [--seq 8192] [--context 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loomax.lm.loss import lm_loss_for  # noqa: E402
from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.attention import causal_attention  # noqa: E402
from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

CASES = (("no split", 1, "ring"), ("ring", None, "ring"), ("all_gather", None, "all_gather"))
HEADS, KV_HEADS, HEAD_SIZE, EOS = 8, 2, 64, 0


def runtime(context: int) -> MeshRuntime:
    mesh = MeshConfig(data=1, context=context).build(jax.devices()[:context])
    return MeshRuntime(mesh, make_axis_mappings())


def attention_memory(seq: int, context: int, variant: str) -> tuple[float, float]:
    """Forward + backward of one causal attention (8 query heads, 2 KV heads of 64, four
    documents): ``(temporary MiB, argument MiB)`` per device."""
    rt = runtime(context)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, seq, HEADS, HEAD_SIZE))
    k, v = (jax.random.normal(key, (1, seq, KV_HEADS, HEAD_SIZE)) for key in keys[1:])
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), seq // 4)[None]
    split = NamedSharding(rt.mesh, P(None, "context"))
    q, k, v, seg = (jax.device_put(x, split) for x in (q, k, v, seg))

    def loss(q, k, v, seg):
        out = causal_attention(
            hax.named(q, (Batch, Position, Heads, HeadSize)),
            hax.named(k, (Batch, KeyPosition, KvHeads, HeadSize)),
            hax.named(v, (Batch, KeyPosition, KvHeads, HeadSize)),
            backend="blockwise",
            segment_ids=hax.named(seg, (Batch, Position)),
            context_parallel=variant,
        )
        return out.array.sum()

    with rt.mesh_context():
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes / 2**20, stats.argument_size_in_bytes / 2**20


def step_speed(seq: int, context: int, variant: str, steps: int) -> tuple[float, float]:
    """A tiny Llama's loss and gradients on one row of ``seq`` tokens (documents at EOS):
    ``(tokens/s, temporary MiB per device)``."""
    rt = runtime(context)
    config = LlamaConfig(
        seq_len=seq, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4,
        num_kv_heads=2, context_parallel=variant, attn_backend="blockwise",
    )  # fmt: skip
    model = config.build(256, key=jax.random.PRNGKey(0))
    tokens = rt.shard_batch(jax.random.randint(jax.random.PRNGKey(1), (1, seq), 0, 256))
    loss_fn = lm_loss_for(config, eos_id=EOS)

    def step(model, tokens):
        return jax.grad(lambda m: (lambda s, w: s / w)(*loss_fn(m, tokens)))(model)

    with rt.mesh_context():
        compiled = jax.jit(step).lower(model, tokens).compile()
        jax.block_until_ready(compiled(model, tokens))
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(compiled(model, tokens))
    seconds = (time.perf_counter() - start) / steps
    return seq / seconds, compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--context", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"sequence {args.seq}, context {args.context} ({DEVICES} fake CPU devices)")
    print(
        f"{'':12} {'attn temp MiB':>14} {'attn args MiB':>14} {'step tok/s':>11} {'step temp MiB':>14}"
    )
    for name, context, variant in CASES:
        context = context or args.context
        temp, arguments = attention_memory(args.seq, context, variant)
        speed, step_temp = step_speed(args.seq, context, variant, args.steps)
        print(f"{name:12} {temp:14.1f} {arguments:14.1f} {speed:11.0f} {step_temp:14.1f}")


if __name__ == "__main__":
    main()
