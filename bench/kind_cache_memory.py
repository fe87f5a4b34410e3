"""Decode-cache memory of a cache per kind of layer (``models/decoding/kind_cache.py``)
against one full-length cache for every layer, from the caches' own array shapes.

Gemma 3 27B's shape (62 layers, 16 KV heads of 128, bf16, window 1,024 on five layers of
every six: 52 local, 10 global) at several context lengths: nothing is allocated (the model
and caches are ``jax.eval_shape``d). With ``--compile``, also a compiled decode step of a
small mixed model (24 layers, 4,096 positions, f32) on this machine's CPU: XLA's memory
analysis (arguments, temporaries) of one step, the cache donated, each way.

    PYTHONPATH=src python bench/kind_cache_memory.py [--compile]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from loomax.models import LmConfig
from loomax.models.decoding.kind_cache import cache_bytes, init_kind_cache

Gemma3 = LmConfig.get_choice_class("gemma3_text")
GEMMA3_27B = Gemma3(
    seq_len=131072, hidden_dim=5376, intermediate_dim=21504, num_layers=62, num_heads=32,
    num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
)  # fmt: skip


def shapes(config, vocab: int, contexts, dtype) -> list[dict]:
    model = jax.eval_shape(lambda: config.build(vocab, key=jax.random.PRNGKey(0)))
    rows = []
    for n in contexts:
        full = jax.eval_shape(lambda n=n: model.init_cache((), n, dtype))
        kinds = jax.eval_shape(lambda n=n: init_kind_cache(model, (), n, dtype))
        f, k = cache_bytes(full), cache_bytes(kinds)
        rows.append(dict(context=n, full_bytes=f, by_kind_bytes=k, full_per_token=f / n,
                         by_kind_per_token=k / n, ratio=f / k))  # fmt: skip
    return rows


def compiled_step() -> dict:
    """XLA memory analysis of one donated decode step, per-kind cache vs one full cache."""
    from loomax.models.decoding.generate import _cached_steps

    config = Gemma3(seq_len=4096, hidden_dim=64, intermediate_dim=64, num_layers=24,
                    num_heads=4, num_kv_heads=4, head_dim=64, sliding_window=64)  # fmt: skip
    model = jax.eval_shape(lambda: config.build(61, key=jax.random.PRNGKey(0)))
    step = jax.jit(_cached_steps(0.0, None, None, None).next.__wrapped__, donate_argnums=1)
    out = {}
    for name, make in [
        ("by_kind", lambda: init_kind_cache(model, (), 4096, jnp.float32)),
        ("full", lambda: model.init_cache((), 4096, jnp.float32)),
    ]:
        cache = jax.eval_shape(make)
        vec = jax.ShapeDtypeStruct((61,), jnp.float32)
        state = (cache, vec, jax.ShapeDtypeStruct((61,), bool))
        args = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.uint32))
        memory = step.lower(model, state, *args).compile().memory_analysis()
        out[name] = dict(cache_bytes=cache_bytes(cache), arguments=memory.argument_size_in_bytes,
                         temporaries=memory.temp_size_in_bytes, aliased=memory.alias_size_in_bytes)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also compile a small decode step")
    args = parser.parse_args()
    rows = shapes(GEMMA3_27B, 262144, (8192, 32768, 131072), jnp.bfloat16)
    print("Gemma 3 27B shape, bf16 (from array shapes; nothing allocated):")
    print(f"{'context':>8} {'full GiB':>9} {'by kind GiB':>12} {'full KiB/tok':>13} "
          f"{'by kind KiB/tok':>16} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['context']:>8} {r['full_bytes'] / 2**30:>9.2f} {r['by_kind_bytes'] / 2**30:>12.2f} "
              f"{r['full_per_token'] / 1024:>13.1f} {r['by_kind_per_token'] / 1024:>16.1f} "
              f"{r['ratio']:>6.2f}")  # fmt: skip
    result = {"gemma3_27b_bf16": rows}
    if args.compile:
        result["compiled_step_cpu"] = compiled_step()
        print(
            "one decode step, 24 layers (4 global), 4096 positions, f32, CPU XLA memory analysis:"
        )
        for name, m in result["compiled_step_cpu"].items():
            print(f"  {name:>8}: cache {m['cache_bytes'] / 2**20:.1f} MiB, arguments "
                  f"{m['arguments'] / 2**20:.1f} MiB, temporaries {m['temporaries'] / 2**20:.1f} MiB")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
