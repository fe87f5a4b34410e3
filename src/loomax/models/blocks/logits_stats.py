"""Statistics of the logits (``taps.STATS``) taken block by block, without the full matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loomax.models.blocks import taps


def row_blocks(x: jax.Array, block: int) -> jax.Array:
    """``x`` as ``[blocks, block, ...]``, its rows padded with zeros to a multiple of ``block``."""
    n = x.shape[0]
    pad = (-n) % block
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, block, *x.shape[1:])


def logits_stats(h: jax.Array, w: jax.Array, block_size: int) -> dict[str, jax.Array]:
    """``taps.STATS`` of the logits ``h @ w.T`` (``[tokens, embed]`` by ``[vocab, embed]``),
    ``block_size`` tokens at a time so the whole matrix never exists. Two passes over the
    blocks (the head's matmul twice, on the steps that ask): sums and the largest
    magnitude, then the centred squares and the near-zero count against the RMS. Exact, and
    outside the gradient."""
    h, w = jax.lax.stop_gradient(h), jax.lax.stop_gradient(w.astype(h.dtype))
    n, vocab = h.shape[0], w.shape[0]
    block = min(block_size, n)
    xs = (row_blocks(h, block), row_blocks(jnp.ones((n,), jnp.float32), block))

    def logits(h_b, valid):
        z = jnp.dot(h_b, w.T, preferred_element_type=jnp.float32)
        return z, jnp.broadcast_to(valid[:, None], z.shape)  # padding rows do not count

    def sums(carry, xs):
        z, v = logits(*xs)
        total, square, peak = carry
        peak = jnp.maximum(peak, jnp.max(jnp.abs(z) * v))
        return (total + jnp.sum(z * v), square + jnp.sum(z * z * v), peak), None

    zero = jnp.zeros((), jnp.float32)
    (total, square, peak), _ = jax.lax.scan(sums, (zero, zero, zero), xs)
    count = n * vocab
    mean, rms = total / count, jnp.sqrt(square / count)

    def spread(carry, xs):
        z, v = logits(*xs)
        centred, near = carry
        centred = centred + jnp.sum(jnp.square(z - mean) * v)
        return (centred, near + jnp.sum((jnp.abs(z) < taps.NEAR_ZERO * rms) * v)), None

    (centred, near), _ = jax.lax.scan(spread, (zero, zero), xs)
    std = jnp.sqrt(centred / count)
    return {"mean": mean, "std": std, "absmax": peak, "rms": rms, "near_zero": near / count}
