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
