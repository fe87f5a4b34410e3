"""The fixed-schedule causal diagonal (``models/attention/causal_diagonal.py``) against the blockwise
kernel's run-time skips: the same values and gradients, and only the visible pairs counted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.attention.causal_diagonal import diagonal_backward, diagonal_forward
from loomax.models.attention.flash import (
    backward_blocks,
    finish,
    forward_blocks,
    forward_state,
    key_blocks,
    query_blocks,
)
from loomax.plan.flops import count_step

B, KV, GROUP, D, BLOCK = 1, 2, 2, 8, 4
SCALE = D**-0.5


def _inputs(length: int):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, KV, GROUP, length, D), jnp.float32)
    k, v = (jax.random.normal(key, (B, KV, length, D), jnp.float32) for key in keys[1:3])
    g = jax.random.normal(keys[3], q.shape, jnp.float32)
    pos = jnp.arange(length, dtype=jnp.int32)
    seg = (jnp.arange(length, dtype=jnp.int32) // 5)[None]  # documents across blocks
    return q, k, v, g, pos, seg


def _attention(forward, backward, length: int):
    """Output, log-sum-exp and (dq, dk, dv) blocks of causal self-attention by blocks."""
    q, k, v, g, pos, seg = _inputs(length)
    queries = query_blocks(q, pos, seg, BLOCK)
    keys = key_blocks(k, v, pos, seg, BLOCK)
    out, lse = finish(forward(queries, forward_state(queries), keys, SCALE))
    gb = query_blocks(g, pos, seg, BLOCK)[0]  # g cut (and padded) as the queries are
    grads = (gb, lse, jnp.sum(gb * out, axis=-1))
    return out, lse, backward(queries, grads, jnp.zeros(queries[0].shape), keys, SCALE)


def _blockwise_backward(queries, grads, dq, keys, scale):
    return backward_blocks(queries, *grads, dq, keys, scale)


@pytest.mark.parametrize("length", [16, 14])  # 4 blocks; 4 blocks, the last padded
def test_diagonal_equals_the_blockwise_kernel(length):
    got = _attention(diagonal_forward, diagonal_backward, length)
    want = _attention(forward_blocks, _blockwise_backward, length)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_diagonal_counts_only_the_visible_block_pairs():
    """8 blocks: 36 pairs on or below the diagonal (the diagonal ones whole) of 64; the
    blockwise kernel's run-time cond is charged all 64."""
    q, k, v, _, pos, seg = _inputs(8 * BLOCK)
    queries, keys = query_blocks(q, pos, seg, BLOCK), key_blocks(k, v, pos, seg, BLOCK)

    def count(forward):
        jaxpr = jax.make_jaxpr(lambda qs, ks: forward(qs, forward_state(qs), ks, SCALE))
        return count_step(jaxpr(queries, keys)).total_flops

    pair = 2 * 2 * B * KV * GROUP * BLOCK * BLOCK * D  # scores and output of one block pair
    assert count(diagonal_forward) == 36 * pair
    assert count(forward_blocks) == 64 * pair
