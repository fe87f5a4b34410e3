"""Causal attention within one run of blocks, computing only the block pairs on or below the
diagonal, in a schedule of fixed length (no run-time skips).

Query and key blocks 0..m-1 share their positions (a diagonal: a zig-zag chunk over itself,
``models/attention/ring_attention.py``). Query block a sees key blocks 0..a. Paired with block
m-1-a, the two see m + 1 key blocks together, the same for every pair: a scan of m + 1
steps over m / 2 pairs visits exactly the visible block pairs (the diagonal blocks whole, a
causal mask inside them and the off-diagonal ones). A static count (``plan/flops.py``)
charges them and nothing more, where ``forward_blocks``' run-time cond per pair is charged
the whole square. An odd number of blocks falls back to ``forward_blocks`` / ``backward_blocks``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loomax.models.attention.flash import (
    acc_dtype,
    backward_blocks,
    block_at,
    forward_blocks,
    grad_step,
    put_block,
    softmax_step,
    tie_to_queries,
)


def _pick(first, a, b):
    return jax.tree.map(lambda x, y: jnp.where(first, x, y), a, b)


def _schedule(p, t):
    """At step ``t`` of pair ``p`` (blocks p and m-1-p): whether block p queries, and which
    key block (block p sees keys 0..p, block m-1-p keys 0..m-1-p: m + 1 steps)."""
    first = t <= p
    return first, jnp.where(first, t, t - p - 1)


def diagonal_forward(queries, state, keys, scale: float):
    """``forward_blocks(queries, state, keys, scale)`` for a diagonal (causal), visiting only
    the visible block pairs."""
    m = queries[0].shape[0]
    if m % 2:
        return forward_blocks(queries, state, keys, scale)

    def per_pair(state, p):
        qa, qz = tie_to_queries(block_at(queries, p), block_at(queries, m - 1 - p))

        def step(states, t):
            first, index = _schedule(p, t)
            pair = (*_pick(first, qa, qz), *block_at(keys, index))
            new = softmax_step(_pick(first, *states), pair, scale)
            return _pick(first, (new, states[1]), (states[0], new)), None

        pair_states = (block_at(state, p), block_at(state, m - 1 - p))
        (sa, sz), _ = jax.lax.scan(step, pair_states, jnp.arange(m + 1))
        return put_block(put_block(state, p, sa), m - 1 - p, sz), None

    return jax.lax.scan(per_pair, state, jnp.arange(m // 2))[0]


def diagonal_backward(queries, grads, dq, keys, scale: float, dkv=None):
    """``backward_blocks(queries, *grads, dq, keys, scale, dkv=dkv)`` (``grads``: ``(gb, lb,
    db)``) for a diagonal: ``(dq, dk, dv)`` blocks, visiting only the visible block pairs."""
    m = queries[0].shape[0]
    if m % 2:
        return backward_blocks(queries, *grads, dq, keys, scale, dkv=dkv)

    def per_pair(carry, p):
        dq, dkv = carry
        qa, qz = block_at(queries, p), block_at(queries, m - 1 - p)
        ga, gz = block_at(grads, p), block_at(grads, m - 1 - p)

        def step(carry, t):
            dqs, dkv = carry
            first, index = _schedule(p, t)
            pair = (*_pick(first, qa, qz), *block_at(keys, index))
            dq_new, dk_b, dv_b = grad_step(_pick(first, *dqs), pair, _pick(first, ga, gz), scale)
            dqs = _pick(first, (dq_new, dqs[1]), (dqs[0], dq_new))
            dkv = put_block(dkv, index, jax.tree.map(jnp.add, block_at(dkv, index), (dk_b, dv_b)))
            return (dqs, dkv), None

        dqs = (block_at(dq, p), block_at(dq, m - 1 - p))
        ((dqa, dqz), dkv), _ = jax.lax.scan(step, (dqs, dkv), jnp.arange(m + 1))
        return (put_block(put_block(dq, p, dqa), m - 1 - p, dqz), dkv), None

    if dkv is None:
        dkv = (jnp.zeros(keys[0].shape, acc_dtype(queries[0].dtype)),) * 2
    (dq, (dk, dv)), _ = jax.lax.scan(per_pair, (dq, dkv), jnp.arange(m // 2))
    return dq, dk, dv
