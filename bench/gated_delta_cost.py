"""XLA's cost of the gated delta rule per token and head (models/blocks/gated_delta.py): the
chunked WY form at three chunk sizes (one chunk compiled: XLA's cost analysis counts a
loop's body once) against the recurrence's one step, beside causal softmax attention's
score matmuls at 4,096 positions. Compile-only figures (no timing): run with
``PYTHONPATH=src python bench/gated_delta_cost.py``."""

import jax
import jax.numpy as jnp

from loomax.models.blocks.gated_delta import chunked_gated_delta, recurrent_gated_delta

H, D = 16, 128
sd = jax.ShapeDtypeStruct


def cost(fn, T):
    args = (sd((1, T, H, D), jnp.float32),) * 3 + (sd((1, T, H), jnp.float32),) * 2
    c = jax.jit(fn).lower(*args).compile().cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return c.get("flops", 0), c.get("bytes accessed", 0)


for C in (32, 64, 128):
    f, b = cost(
        lambda q, k, v, g, be, C=C: chunked_gated_delta(q, k, v, g, be, C), C
    )  # one chunk: one trip
    print(
        f"chunked C={C}: {f / C / H:.0f} flops/token/head, {b / C / H / 1e3:.1f} kB/token/head (one chunk compiled, XLA cost analysis)"
    )
f, b = cost(lambda q, k, v, g, be: recurrent_gated_delta(q, k, v, g, be), 1)
print(f"recurrent: {f / H:.0f} flops/token/head, {b / H / 1e3:.1f} kB/token/head (one step)")
print(
    f"causal softmax attention at 4096 positions, head 128: {2 * 2 * 2048 * 128} flops/token/head (QK^T and PV, half the square)"
)

# Decode memory per layer and sequence at Qwen3-Next-80B-A3B's widths (hidden 2048, 16 key
# and 32 value heads of 128, conv 4; its full-attention layers: 2 KV heads of 256), bf16,
# from the arrays' shapes (jax.eval_shape: nothing allocated).
from loomax.models.blocks.gated_deltanet import GatedDeltaNet  # noqa: E402

net = jax.eval_shape(lambda: GatedDeltaNet.init(2048, 16, 32, 128, 128, key=jax.random.PRNGKey(0)))
cache = jax.eval_shape(lambda: GatedDeltaNet.init_cache(net, 1, jnp.bfloat16))
delta = sum(a.size * a.dtype.itemsize for a in cache)
gqa, mha = 2 * 2 * 256 * 2, 2 * 2048 * 2  # bytes a position: keys + values, bf16
print(f"Gated DeltaNet cache: {delta / 2**20:.2f} MiB a sequence, whatever its length")
for name, per in (("full attention, 2 KV heads of 256", gqa), ("full attention, width 2048", mha)):
    print(
        f"{name}: {per} B a position; equal at {delta / per:.0f} positions; at 32,768: "
        f"{32768 * per / 2**20:.0f} MiB ({32768 * per / delta:.0f}x)"
    )
