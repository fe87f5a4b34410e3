"""Causal attention over a sequence split on the ``context`` mesh axis (context parallelism).

Both variants run inside ``shard_map``: every device keeps its own queries (its two
zig-zag chunks, ``models/sequence_layout.py``), batch rows and heads split as the compute
mapping says.

- ``ring``: the key/value blocks travel around the ring of n devices (``lax.ppermute``),
  n - 1 hops; each device attends its queries to the block it holds, the online softmax
  (running max, sum and output per query block) carried on from hop to hop. The custom backward
  sends the blocks around again with their dK/dV accumulators, which arrive back at their
  owners after the last hop: no device ever holds more than one block of keys, values or
  their gradients, forward or backward. Memory per device O(seq / n).
- ``all_gather``: the keys and values (and their positions and document ids) are
  all-gathered over the axis, then each device attends its queries to the whole sequence;
  the backward reduce-scatters dK/dV. Simpler, one collective per layer; the gathered K/V
  are O(seq) per device (small with grouped-query attention).

The per-block kernel is the ``blockwise`` backend's (``models/flash.py``), with the true
positions and document ids of queries and keys, so causal and document masks hold across
the split. On TPU (splash) or GPU (cuDNN) the same ring would run their kernels per block;
not done yet (docs/sharding.md).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from loomax.models.axes import Heads
from loomax.models.flash import (
    backward_blocks,
    finish,
    flash_attention_at,
    forward_blocks,
    forward_state,
    grad_blocks,
    key_blocks,
    merge_blocks,
    query_blocks,
)
from loomax.models.sequence_layout import context_axes, context_ways, zigzag_order
from loomax.models.splash import concrete_mesh, mapped_axes

VARIANTS = ("ring", "all_gather")
"""``model.context_parallel``: how attention crosses a split sequence."""


def context_parallel_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, seg, scale: float, block: int, variant: str
) -> jax.Array:
    """Causal attention of a sequence laid out over the context axes of the mesh in context.

    ``q`` is ``[B, K, G, T, D]``, ``k``/``v`` are ``[B, K, T, D]``, ``seg`` is ``[B, T]``
    document ids or None, all in the zig-zag layout. Returns ``q``'s shape and dtype.
    """
    if variant not in VARIANTS:
        raise ValueError(f"model.context_parallel must be one of {VARIANTS}, got {variant!r}")
    mesh, axes, ways = concrete_mesh(), context_axes(), context_ways()
    B, K, G, T, _ = q.shape
    positions = jnp.asarray(zigzag_order(T, ways), jnp.int32)
    if seg is None:
        seg = jnp.zeros((B, T), jnp.int32)
    ctx = axes[0] if len(axes) == 1 else axes
    batch = mapped_axes(mesh, "batch", B, keep_trivial=True)
    heads = mapped_axes(mesh, Heads, K * G, K, keep_trivial=True)
    block = min(block, T // (2 * ways))  # a block never straddles two zig-zag chunks
    if variant == "ring":
        local = partial(ring_attention, scale=scale, block=block, axis=ctx, ways=ways)
    else:
        local = partial(all_gather_attention, scale=scale, block=block, axis=ctx)
    q_spec, kv_spec = P(batch, heads, None, ctx), P(batch, heads, ctx)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(ctx), P(batch, ctx)),
        out_specs=q_spec,
        check_vma=False,  # the blockwise kernel's scans start from unvarying zeros
    )(q, k, v, positions, seg)


def all_gather_attention(q, k, v, pos, seg, *, scale: float, block: int, axis):
    """This device's queries over the keys and values gathered from every device of ``axis``
    (inside ``shard_map``; ``pos``/``seg`` are the local slots' true positions and documents)."""

    def gather(x, dim):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    k_pos, k_seg = gather(pos, 0), gather(seg, 1)
    return flash_attention_at(q, gather(k, 2), gather(v, 2), pos, k_pos, seg, k_seg, scale, block)


def ring_attention(q, k, v, pos, seg, *, scale: float, block: int, axis, ways: int):
    """This device's queries over every device's keys and values, passed around the ring of
    ``ways`` devices of ``axis`` (inside ``shard_map``)."""
    return _ring(q, k, v, pos, seg, scale, block, axis, ways)


def _hop(tree, axis, ways: int):
    """Every device's ``tree`` to the next device of the ring."""
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % ways) for i in range(ways)])


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, pos, seg, scale, block, axis, ways):
    return _ring_forward(q, k, v, pos, seg, scale, block, axis, ways)[0]


def _ring_forward(q, k, v, pos, seg, scale, block, axis, ways):
    """The online softmax carried around the ring: each hop's keys continue it where the
    last left it, block by block (no per-hop partial outputs to combine). The keys and values
    travel already cut into blocks, so no hop re-lays them out."""
    T = q.shape[-2]
    queries = query_blocks(q, pos, seg, block)
    keys = key_blocks(k, v, pos, seg, block)
    state = forward_blocks(queries, forward_state(queries), keys, scale)

    def step(carry, _):
        state, held = carry
        held = _hop(held, axis, ways)
        return (forward_blocks(queries, state, held, scale), held), None

    (state, _), _ = jax.lax.scan(step, (state, keys), None, length=ways - 1)
    out, lse = finish(state)
    return merge_blocks(out, 3)[..., :T, :].astype(q.dtype), merge_blocks(lse, 3)[..., :T]


def _ring_fwd(q, k, v, pos, seg, scale, block, axis, ways):
    out, lse = _ring_forward(q, k, v, pos, seg, scale, block, axis, ways)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(scale, block, axis, ways, residuals, g):
    q, k, v, pos, seg, out, lse = residuals
    T, acc = q.shape[-2], lse.dtype
    delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1)
    queries = query_blocks(q, pos, seg, block)
    gb, lb, db = grad_blocks(g, lse, delta, block)
    keys = key_blocks(k, v, pos, seg, block)

    def attend(dq, held):
        return backward_blocks(queries, gb, lb, db, dq, held, scale)

    dq, dk, dv = attend(jnp.zeros(queries[0].shape, acc), keys)

    def step(carry, _):
        dq, held, grads = carry
        held, grads = _hop((held, grads), axis, ways)  # a block travels with its dK/dV
        dq, dk_s, dv_s = attend(dq, held)
        return (dq, held, (grads[0] + dk_s, grads[1] + dv_s)), None

    (dq, _, grads), _ = jax.lax.scan(step, (dq, keys, (dk, dv)), None, length=ways - 1)
    dk, dv = _hop(grads, axis, ways)  # the last hop brings each block's gradients home
    dq = merge_blocks(dq, 3)[..., :T, :]
    dk, dv = (merge_blocks(x, 2)[..., :T, :] for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
