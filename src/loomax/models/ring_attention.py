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

  Only the chunk pairs the causal mask lets through are computed, and which those are is
  known from the layout (device i holds chunks i and 2n-1-i): with its own keys, chunk i
  over chunk i and 2n-1-i over 2n-1-i (causal diagonals, only their visible block pairs:
  ``models/causal_diagonal.py``), 2n-1-i over i (all visible; i over 2n-1-i is hidden);
  with device j's keys, both query chunks over key chunk j if j < i, else query chunk
  2n-1-i over both key chunks: two whole chunk pairs either way, with no causal mask, one
  ``lax.cond`` between branches of equal cost. So a static count (``plan/flops.py``: a cond
  costs its dearer branch) charges the causal work plus the hidden halves of the diagonal
  blocks (1/(2nm) over, m blocks a chunk). Document masks apply in every pair (segment ids
  of the true positions); pairs of blocks in different documents are computed and masked,
  not skipped. The output and log-sum-exp are named ``RING_RESIDUALS``: a remat policy that
  saves them (``model.remat_save``) keeps the backward pass from running the ring forward
  again.
- ``all_gather``: the keys and values (and their positions and document ids) are
  all-gathered over the axis, then each device attends its queries to the whole sequence;
  the backward reduce-scatters dK/dV. Simpler, one collective per layer; the gathered K/V
  are O(seq) per device (small with grouped-query attention).

The per-block kernel is the ``blockwise`` backend's (``models/flash.py``), with the true
positions and document ids of queries and keys, so causal and document masks hold across
the split; or, for the ring where ``ring_kernel`` picks it (TPU), splash per chunk pair
(``models/ring_splash.py``). cuDNN (GPU) is not used per block (docs/sharding.md).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.models.axes import Heads
from loomax.models.causal_diagonal import diagonal_backward, diagonal_forward
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
from loomax.models.ring_splash import splash_ring_attention
from loomax.models.sequence_layout import context_axes, context_ways, zigzag_order
from loomax.models.splash import (
    concrete_mesh,
    mapped_axes,
    mesh_platform,
    splash_unsupported_reason,
)

VARIANTS = ("ring", "all_gather")
"""``model.context_parallel``: how attention crosses a split sequence."""
RING_BLOCK = 128
"""Largest query and key block of the blockwise ring: its score tiles (block^2 x heads) are
the one part of a device's working set that does not shrink with the context axis (at 8,192
positions, context 4, 8 heads: 0.5 MiB a tile at 128, 2 MiB at 256; a tiny Llama's CPU step
ran as fast with 128 as with 256, docs/sharding.md)."""
RING_RESIDUALS = "ring_residuals"
"""Checkpoint name of the ring's output and log-sum-exp (its backward's residuals)."""


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg,
    scale: float,
    block: int,
    variant: str,
    backend: str = "blockwise",
    splash_blocks: tuple[int, int] = (512, 512),
) -> jax.Array:
    """Causal attention of a sequence laid out over the context axes of the mesh in context.

    ``q`` is ``[B, K, G, T, D]``, ``k``/``v`` are ``[B, K, T, D]``, ``seg`` is ``[B, T]``
    document ids or None, all in the zig-zag layout. Returns ``q``'s shape and dtype.
    The per-block kernel follows ``backend`` (``model.attn_backend``; ``ring_kernel``):
    ``block`` is blockwise's, ``splash_blocks`` splash's query and key blocks.
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
    kernel = ring_kernel(backend, variant, T // (2 * ways), splash_blocks)
    block = min(block, T // (2 * ways))  # a block never straddles two zig-zag chunks
    if variant == "ring":
        block = min(block, RING_BLOCK)
    if kernel == "splash":
        local = partial(
            splash_ring_attention,
            scale=scale,
            blocks=splash_blocks,
            axis=ctx,
            ways=ways,
            interpret=mesh_platform() != "tpu",
            residual_name=RING_RESIDUALS,
        )
    elif variant == "ring":
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


def ring_kernel(
    backend: str,
    variant: str,
    chunk: int,
    splash_blocks: tuple[int, int] = (512, 512),
) -> str:
    """The per-block kernel of context-parallel attention (``models/ring_attention.py``):
    ``splash`` for the ring where ``backend`` is ``splash`` (asked for: it has been compiled
    for TPUs, never run on one, and its estimate is below the blockwise ring's, see
    docs/sharding.md), else ``blockwise`` (``auto`` on every platform; ``all_gather`` always).
    ``splash`` asked for with a chunk it cannot serve raises ``ConfigError``."""
    if variant != "ring" or backend != "splash":
        return "blockwise"
    reason = splash_unsupported_reason(chunk, *splash_blocks)
    if reason:
        raise ConfigError(
            f"model.attn_backend splash cannot serve the ring's chunk pairs ({chunk} "
            f"positions a zig-zag chunk: seq_len / (2 x context)): {reason}"
        )
    return "splash"


def all_gather_attention(q, k, v, pos, seg, *, scale: float, block: int, axis):
    """This device's queries over the keys and values gathered from every device of ``axis``
    (inside ``shard_map``; ``pos``/``seg`` are the local slots' true positions and documents)."""

    def gather(x, dim):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    k_pos, k_seg = gather(pos, 0), gather(seg, 1)
    return flash_attention_at(q, gather(k, 2), gather(v, 2), pos, k_pos, seg, k_seg, scale, block)


def ring_attention(q, k, v, pos, seg, *, scale: float, block: int, axis, ways: int):
    """This device's queries over every device's keys and values, passed around the ring of
    ``ways`` devices of ``axis`` (inside ``shard_map``; the zig-zag layout: ``pos`` are two
    chunks of true positions, ``sequence_layout.zigzag_order``)."""
    return _ring(q, k, v, pos, seg, scale, block, axis, ways)


def _hop(tree, axis, ways: int):
    """Every device's ``tree`` to the next device of the ring."""
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % ways) for i in range(ways)])


def _chunks(q, k, v, pos, seg, block):
    """The blocked queries and keys of this device's early and late zig-zag chunks: a pair
    ``(early, late)`` of each (a block never straddles the two)."""
    c = q.shape[-2] // 2
    halves = (slice(0, c), slice(c, 2 * c))
    queries = tuple(query_blocks(q[..., h, :], pos[h], seg[:, h], block) for h in halves)
    keys = tuple(key_blocks(k[..., h, :], v[..., h, :], pos[h], seg[:, h], block) for h in halves)
    return queries, keys


def _from_earlier(held, early) -> jax.Array:
    """Whether the ``held`` keys come from a device j before this one i (their early chunk
    precedes our ``early`` queries): then both our query chunks see their early chunk and
    nothing of their late one; else (j > i) our late chunk sees both of theirs and our early
    chunk nothing."""
    return held[0][2][0, 0] < early[1][0, 0]


def _join(blocks, axis: int, length: int):
    """The two chunks' blocks back into one ``[..., 2 x length, ...]`` array along ``axis``."""
    parts = [jax.lax.slice_in_dim(merge_blocks(b, axis), 0, length, axis=axis) for b in blocks]
    return jnp.concatenate(parts, axis=axis)


def _after(x, anchor):
    """``x``, made to wait for ``anchor``: ``x`` plus a zero computed from ``anchor[0, ...]``
    (0 times whether it is NaN: a zero whatever the anchor holds, inf and NaN included).
    XLA:CPU drops optimization barriers before it schedules, and its concurrency-optimized
    scheduler starts a value as soon as its operands exist: the backward's zero dQ
    accumulators and its layout of the cotangent would be built at the start of the
    program and held through the forward pass (docs/sharding.md, "Memory per device")."""
    first = jax.lax.index_in_dim(anchor.reshape(-1), 0, keepdims=False)
    return x + jnp.isnan(first).astype(x.dtype) * 0


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, pos, seg, scale, block, axis, ways):
    return _ring_forward(q, k, v, pos, seg, scale, block, axis, ways)[0]


def _ring_forward(q, k, v, pos, seg, scale, block, axis, ways):
    """The online softmax carried around the ring: each hop's keys continue it where the
    last left it, block by block (no per-hop partial outputs to combine). The keys and values
    travel already cut into blocks, so no hop re-lays them out. Only visible chunk pairs are
    computed (module docstring), the off-diagonal ones without a causal mask."""
    c = q.shape[-2] // 2
    (qe, ql), (ke, kl) = _chunks(q, k, v, pos, seg, block)

    def attend(queries, state, keys):
        return forward_blocks(queries, state, keys, scale, causal=False)

    state_e = diagonal_forward(qe, forward_state(qe), ke, scale)
    state_l = diagonal_forward(ql, attend(ql, forward_state(ql), ke), kl, scale)

    def visit(states, held):
        (se, sl), (he, hl) = states, held
        sl = attend(ql, sl, he)
        earlier = _from_earlier(held, qe)
        x = jax.lax.cond(earlier, lambda: attend(qe, se, he), lambda: attend(ql, sl, hl))
        pick = partial(jax.tree.map, lambda a, b: jnp.where(earlier, a, b))
        return pick(x, se), pick(sl, x)

    def step(carry, _):
        states, held = carry
        held = _hop(held, axis, ways)
        return (visit(states, held), held), None

    (states, _), _ = jax.lax.scan(step, ((state_e, state_l), (ke, kl)), None, length=ways - 1)
    out, lse = zip(*(finish(s) for s in states), strict=True)
    return _join(out, 3, c).astype(q.dtype), _join(lse, 3, c)


def _ring_fwd(q, k, v, pos, seg, scale, block, axis, ways):
    out, lse = _ring_forward(q, k, v, pos, seg, scale, block, axis, ways)
    out, lse = checkpoint_name(out, RING_RESIDUALS), checkpoint_name(lse, RING_RESIDUALS)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(scale, block, axis, ways, residuals, g):
    q, k, v, pos, seg, out, lse = residuals
    c, acc = q.shape[-2] // 2, lse.dtype
    g = _after(g, lse)  # the backward's layouts and accumulators wait for the forward
    delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1)
    (qe, ql), (ke, kl) = _chunks(q, k, v, pos, seg, block)
    ge, gl = (grad_blocks(g[..., h, :], lse[..., h], delta[..., h], block)
              for h in (slice(0, c), slice(c, 2 * c)))  # fmt: skip

    def attend(queries, grads, dq, keys, dkv):
        dq, dk, dv = backward_blocks(queries, *grads, dq, keys, scale, causal=False, dkv=dkv)
        return dq, (dk, dv)

    def zeros(like):  # accumulators, built once the forward is done
        return _after(jnp.zeros(like.shape, acc), lse)

    dq_e, *dkv_e = diagonal_backward(qe, ge, zeros(qe[0]), ke, scale, (zeros(ke[0]),) * 2)
    dq_l, dkv_e = attend(ql, gl, zeros(ql[0]), ke, tuple(dkv_e))
    dq_l, *dkv_l = diagonal_backward(ql, gl, dq_l, kl, scale, (zeros(kl[0]),) * 2)
    grads = (dkv_e, tuple(dkv_l))

    def visit(dqs, held, grads):
        (dq_e, dq_l), (he, hl), (dkv_e, dkv_l) = dqs, held, grads

        def early_keys():  # their early keys: both our query chunks add to its dK/dV
            dq_e2, dkv = attend(qe, ge, dq_e, he, dkv_e)
            dq_l2, dkv = attend(ql, gl, dq_l, he, dkv)
            return (dq_e2, dq_l2), (dkv, dkv_l)

        def late_queries():  # our late queries over both their chunks
            dq_l2, dkv_e2 = attend(ql, gl, dq_l, he, dkv_e)
            dq_l2, dkv_l2 = attend(ql, gl, dq_l2, hl, dkv_l)
            return (dq_e, dq_l2), (dkv_e2, dkv_l2)

        return jax.lax.cond(_from_earlier(held, qe), early_keys, late_queries)

    def step(carry, _):
        dqs, held, grads = carry
        held, grads = _hop((held, grads), axis, ways)  # a block travels with its dK/dV
        dqs, grads = visit(dqs, held, grads)
        return (dqs, held, grads), None

    carry = ((dq_e, dq_l), (ke, kl), grads)
    ((dq_e, dq_l), _, grads), _ = jax.lax.scan(step, carry, None, length=ways - 1)
    (dk_e, dv_e), (dk_l, dv_l) = _hop(grads, axis, ways)  # the last hop brings them home
    dq = _join((dq_e, dq_l), 3, c)
    dk, dv = _join((dk_e, dk_l), 2, c), _join((dv_e, dv_l), 2, c)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
