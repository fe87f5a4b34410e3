"""Attention backends: compiled temporary memory and time of forward + backward (figures, not tests).

Each backend alone, and inside a differentiated ``lax.scan`` over ``--layers`` remat'd layers
as the models run it (the segments loop-invariant, which is where JAX hoists work out of
the loop).

.venv/bin/python bench/attention.py [--seq_lens 1024 4096] [--heads 4] [--head_size 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import time

import haliax as hax
import jax
import jax.numpy as jnp

from loomax.models.attention.attention import causal_attention

Q_AXES = ("batch", "position", "heads", "head_size")
KV_AXES = ("batch", "key_position", "heads", "head_size")


def _timed(fn, *args) -> tuple[float, float]:
    """``(temporary MiB, ms of one run after a warm-up)`` of ``jit(fn)``."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return temp, (time.perf_counter() - start) * 1e3


def measure(seq_len: int, heads: int, head_size: int, backend: str) -> tuple[float, float]:
    """Forward + backward of one causal attention: temporary MiB and ms."""
    shape = (1, seq_len, heads, head_size)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, shape) for key in keys)

    def loss(q, k, v):
        out = causal_attention(
            hax.named(q, Q_AXES), hax.named(k, KV_AXES), hax.named(v, KV_AXES), backend=backend
        )
        return out.array.sum()

    return _timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)


def measure_in_scan(
    seq_len: int, heads: int, head_size: int, backend: str, layers: int
) -> tuple[float, float]:
    """Forward + backward of ``layers`` remat'd attention layers in a ``lax.scan`` (each
    layer's output its next input; four documents per row): temporary MiB and ms."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, seq_len, heads, head_size))
    segments = hax.named(jnp.repeat(jnp.arange(4), -(-seq_len // 4))[None, :seq_len], Q_AXES[:2])

    def layer(x, _):
        kv = hax.named(x, KV_AXES)
        out = causal_attention(hax.named(x, Q_AXES), kv, kv, backend=backend, segment_ids=segments)
        return out.array, None

    def loss(x):
        return jax.lax.scan(jax.checkpoint(layer), x, None, length=layers)[0].sum()

    return _timed(jax.grad(loss), x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_size", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["vanilla", "blockwise", "xla"])
    parser.add_argument("--layers", type=int, default=2, help="layers in the scan; 0: leave out")
    args = parser.parse_args()
    scan = f"{args.layers} layers"
    print(
        f"{'seq_len':>8} {'backend':<10} {'temp MiB':>9} {'fwd+bwd ms':>11}"
        + (f" {scan + ' MiB':>14} {scan + ' ms':>13}" if args.layers else "")
    )
    for seq_len in args.seq_lens:
        for backend in args.backends:
            temp, ms = measure(seq_len, args.heads, args.head_size, backend)
            line = f"{seq_len:>8} {backend:<10} {temp:>9.1f} {ms:>11.0f}"
            if args.layers:
                temp, ms = measure_in_scan(
                    seq_len, args.heads, args.head_size, backend, args.layers
                )
                line += f" {temp:>14.1f} {ms:>13.0f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
