"""Attention backends: compiled temporary memory and time of forward + backward (figures, not tests).

.venv/bin/python bench/attention.py [--seq_lens 1024 4096] [--heads 4] [--head_size 64]
"""

from __future__ import annotations

import argparse
import time

import haliax as hax
import jax

from loomax.models.attention import causal_attention


def measure(seq_len: int, heads: int, head_size: int, backend: str) -> tuple[float, float]:
    shape = (1, seq_len, heads, head_size)
    q_axes = ("batch", "position", "heads", "head_size")
    kv_axes = ("batch", "key_position", "heads", "head_size")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, shape) for key in keys)

    def loss(q, k, v):
        out = causal_attention(
            hax.named(q, q_axes), hax.named(k, kv_axes), hax.named(v, kv_axes), backend=backend
        )
        return out.array.sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(compiled(q, k, v))
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    return temp, (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_size", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["vanilla", "blockwise", "xla"])
    args = parser.parse_args()
    print(f"{'seq_len':>8} {'backend':<10} {'temp MiB':>9} {'fwd+bwd ms':>11}")
    for seq_len in args.seq_lens:
        for backend in args.backends:
            temp, ms = measure(seq_len, args.heads, args.head_size, backend)
            print(f"{seq_len:>8} {backend:<10} {temp:>9.1f} {ms:>11.0f}")


if __name__ == "__main__":
    main()
