"""Causal attention over a sequence split on the ``context`` mesh axis (context parallelism).

Both variants run inside ``shard_map``: every device keeps its own queries (its two
zig-zag chunks, ``models/attention/sequence_layout.py``), batch rows and heads split as the compute
mapping says.

- ``ring``: the key/value blocks travel around the ring of n devices (``lax.ppermute``),
  n - 1 hops; each device attends its queries to the block it holds, the online softmax
  (running max, sum and output per query block) carried on from hop to hop. The custom backward
  sends the blocks around again with their dK/dV accumulators, which arrive back at their
  owners after the last hop. Memory per device O(seq / n).

  The transfers overlap the attention: each block is sent on before the device attends to
  it (the first, its own, over its own diagonals), so every hop's collective-permute has
  the block in hand's work between its start and its done; in the backward a block's dK/dV
  partial sum travels one hop behind the block, each device's share started from zeros
  and added once the previous device's sum has arrived, and the last sums go home over the
  device's late diagonal. A hop is one transfer (its leaves packed into one buffer; in a
  CPU program leaf by leaf). So a device holds the block in hand and the one arriving (and in the backward three sets of
  dK/dV: in hand, arriving, leaving). A CPU program (XLA:CPU overlaps nothing) keeps the
  serial backward, one block and one set of dK/dV fewer, and ``_after``.

  Only the chunk pairs the causal mask lets through are computed, and which those are is
  known from the layout (device i holds chunks i and 2n-1-i): with its own keys, chunk i
  over chunk i and 2n-1-i over 2n-1-i (causal diagonals, only their visible block pairs:
  ``models/attention/causal_diagonal.py``), 2n-1-i over i (all visible; i over 2n-1-i is hidden);
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

The per-block kernel is the ``blockwise`` backend's (``models/attention/flash.py``), with the true
positions and document ids of queries and keys, so causal and document masks hold across
the split; or, for the ring where ``ring_kernel`` picks it (TPU), splash per chunk pair
(``models/attention/ring_splash.py``). cuDNN (GPU) is not used per block (docs/sharding.md).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.mesh import current_mesh, mapped_axes, target_platform
from loomax.models.attention.causal_diagonal import diagonal_backward, diagonal_forward
from loomax.models.attention.flash import (
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
from loomax.models.attention.ring_hops import add_partials, ring_hop
from loomax.models.attention.ring_splash import splash_ring_attention
from loomax.models.attention.sequence_layout import context_axes, context_ways, zigzag_order
from loomax.models.attention.sinks import sink_grad
from loomax.models.attention.splash import splash_unsupported_reason
from loomax.models.axes import Heads

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
    sink: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a sequence laid out over the context axes of the mesh in context.

    ``q`` is ``[B, K, G, T, D]``, ``k``/``v`` are ``[B, K, T, D]``, ``seg`` is ``[B, T]``
    document ids or None, all in the zig-zag layout. Returns ``q``'s shape and dtype.
    The per-block kernel follows ``backend`` (``model.attn_backend``; ``ring_kernel``):
    ``block`` is blockwise's, ``splash_blocks`` splash's query and key blocks. ``sink
    [K, G]``: attention sinks (``sinks.py``), on the blockwise kernel (the splash ring has none).
    """
    if variant not in VARIANTS:
        raise ValueError(f"model.context_parallel must be one of {VARIANTS}, got {variant!r}")
    mesh, axes, ways = current_mesh(), context_axes(), context_ways()
    B, K, G, T, _ = q.shape
    positions = jnp.asarray(zigzag_order(T, ways), jnp.int32)
    if seg is None:
        seg = jnp.zeros((B, T), jnp.int32)
    ctx = axes[0] if len(axes) == 1 else axes
    batch = mapped_axes(mesh, "batch", B, keep_trivial=True)
    heads = mapped_axes(mesh, Heads, K * G, K, keep_trivial=True)
    kernel = ring_kernel(backend, variant, T // (2 * ways), splash_blocks)
    if sink is not None and kernel == "splash":
        raise ConfigError("attention sinks are not supported by the splash ring kernel: use "
                          "model.attn_backend blockwise with trainer.mesh.context > 1")  # fmt: skip
    if sink is None:  # a sink of -inf's weight: none (one program for both)
        sink = jnp.full((K, G), -jnp.inf, jnp.float32)
    block = min(block, T // (2 * ways))  # a block never straddles two zig-zag chunks
    if variant == "ring":
        block = min(block, RING_BLOCK)
    if kernel == "splash":
        local = partial(
            _sinkless,
            splash_ring_attention,
            scale=scale,
            blocks=splash_blocks,
            axis=ctx,
            ways=ways,
            interpret=target_platform() != "tpu",
            residual_name=RING_RESIDUALS,
        )
    elif variant == "ring":
        local = partial(
            ring_attention, scale=scale, block=block, axis=ctx, ways=ways,
            cpu_program=cpu_program(),
        )  # fmt: skip
    else:
        local = partial(all_gather_attention, scale=scale, block=block, axis=ctx)
    q_spec, kv_spec = P(batch, heads, None, ctx), P(batch, heads, ctx)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(ctx), P(batch, ctx), P(heads)),
        out_specs=q_spec,
        # Unchecked: the blockwise kernel (models/attention/flash.py) starts its loops and its
        # skipped blocks' cond branches from zeros typed as varying over no mesh axis,
        # against values varying over all of them. jax.lax.pcast(..., to="varying") on
        # the ring's own zero states and accumulators passes the check for the ring's
        # unmasked pairs, but a diagonal with an odd number of blocks (and the all-gather
        # path) runs flash.py's causal backward_blocks, whose skip branch's zeros fail it.
        check_vma=False,
    )(q, k, v, positions, seg, sink)


def _sinkless(attend, q, k, v, pos, seg, sink, **settings):
    """``attend`` (the splash ring) without the sink argument (refused there, -inf here)."""
    return attend(q, k, v, pos, seg, **settings)


def cpu_program() -> bool:
    """Whether the program is compiled for CPUs (``target_platform``): XLA:CPU overlaps no
    transfer with work, and needs ``_after`` to keep the backward's buffers from being
    built at the start of the program; the ring runs its serial backward there."""
    return target_platform() == "cpu"


def ring_kernel(
    backend: str,
    variant: str,
    chunk: int,
    splash_blocks: tuple[int, int] = (512, 512),
) -> str:
    """The per-block kernel of context-parallel attention (``models/attention/ring_attention.py``):
    ``splash`` for the ring where ``backend`` is ``splash`` (asked for: it has been compiled
    for TPUs, never run on one: no default rests on an estimate alone, see
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


def all_gather_attention(q, k, v, pos, seg, sink=None, *, scale: float, block: int, axis):
    """This device's queries over the keys and values gathered from every device of ``axis``
    (inside ``shard_map``; ``pos``/``seg`` are the local slots' true positions and documents;
    ``sink [K, G]`` each head's attention sink)."""

    def gather(x, dim):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    k_pos, k_seg, k, v = gather(pos, 0), gather(seg, 1), gather(k, 2), gather(v, 2)
    return flash_attention_at(q, k, v, pos, k_pos, seg, k_seg, scale, block, None, None, sink)


def ring_attention(
    q, k, v, pos, seg, sink=None, *, scale: float, block: int, axis, ways: int,
    cpu_program: bool = False,
):  # fmt: skip
    """This device's queries over every device's keys and values, passed around the ring of
    ``ways`` devices of ``axis`` (inside ``shard_map``; the zig-zag layout: ``pos`` are two
    chunks of true positions, ``sequence_layout.zigzag_order``). ``cpu_program``: the mesh's
    devices are CPUs (``_after``'s workaround goes into XLA:CPU programs only); ``sink [K, G]``."""
    if sink is None:
        sink = jnp.full(q.shape[1:3], -jnp.inf, jnp.float32)
    return _ring(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu_program)


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


def _after(x, anchor, cpu: bool):
    """``x``, made to wait for ``anchor`` in a CPU program (``cpu``), else ``x`` as it is: ``x``
    plus a zero computed from ``anchor[0, ...]`` (0 times whether it is NaN: a zero whatever
    the anchor holds, inf and NaN included). XLA:CPU drops optimization barriers before it
    schedules, and its concurrency-optimized scheduler starts a value as soon as its operands
    exist: the backward's zero accumulators and its layout of the cotangent would be built
    at the start of the program and held through the forward pass (docs/sharding.md,
    "Memory per device"). TPU and GPU programs are scheduled for memory and latency by XLA's
    own schedulers: there the add would only be work."""
    if not cpu:
        return x
    first = jax.lax.index_in_dim(anchor.reshape(-1), 0, keepdims=False)
    return x + jnp.isnan(first).astype(x.dtype) * 0


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _ring(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu):
    return _ring_forward(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu)[0]


def _ring_forward(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu):
    """The online softmax carried around the ring: each hop's keys continue it where the
    last left it, block by block (no per-hop partial outputs to combine). The keys and values
    travel already cut into blocks, so no hop re-lays them out. Only visible chunk pairs are
    computed (module docstring), the off-diagonal ones without a causal mask.

    Double-buffered: each block is sent on before it is attended to, so every transfer has
    the attention to the block in hand to hide behind (the first, this device's own keys)."""
    c = q.shape[-2] // 2
    (qe, ql), own = _chunks(q, k, v, pos, seg, block)
    (ke, kl) = own

    def attend(queries, state, keys):
        return forward_blocks(queries, state, keys, scale, causal=False)

    def visit(states, held):
        (se, sl), (he, hl) = states, held
        sl = attend(ql, sl, he)
        earlier = _from_earlier(held, qe)
        x = jax.lax.cond(earlier, lambda: attend(qe, se, he), lambda: attend(ql, sl, hl))
        pick = partial(jax.tree.map, lambda a, b: jnp.where(earlier, a, b))
        return pick(x, se), pick(sl, x)

    hop = partial(ring_hop, axis=axis, ways=ways, pack=not cpu)
    held = hop(own) if ways > 1 else None  # in flight over the diagonals
    state_e = diagonal_forward(qe, forward_state(qe, sink), ke, scale)
    state_l = diagonal_forward(ql, attend(ql, forward_state(ql, sink), ke), kl, scale)
    states = (state_e, state_l)

    def step(carry, _):
        states, held = carry
        sent = hop(held)  # the next hop's block, in flight while this one is used
        return (visit(states, held), sent), None

    if ways > 2:
        (states, held), _ = jax.lax.scan(step, (states, held), None, length=ways - 2)
    if ways > 1:
        states = visit(states, held)  # the last block: nothing left to send
    out, lse = zip(*(finish(s) for s in states), strict=True)
    return _join(out, 3, c).astype(q.dtype), _join(lse, 3, c)


def _ring_fwd(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu):
    out, lse = _ring_forward(q, k, v, pos, seg, sink, scale, block, axis, ways, cpu)
    out, lse = checkpoint_name(out, RING_RESIDUALS), checkpoint_name(lse, RING_RESIDUALS)
    return out, (q, k, v, pos, seg, sink, out, lse)


def _ring_bwd(scale, block, axis, ways, cpu, residuals, g):
    """The blocks go round again. In a TPU or GPU program they are double-buffered as in
    the forward, and a block's dK/dV partial sum travels one hop behind it: each device
    starts its share of the block in hand from zeros while the previous device's partial
    sum for that block is in flight, and adds the two after. So every transfer has attention
    work to hide behind: this device's early diagonal and its late queries over its early
    keys while its own block leaves (in the forward's program the same transfer); the last
    hop's partial sums, home to the blocks' owners, behind the late diagonal. In a CPU
    program (``cpu``: XLA:CPU overlaps no transfer with work) a block travels with its dK/dV
    and each device adds to them as they arrive: one block and one set of dK/dV fewer held."""
    q, k, v, pos, seg, sink, out, lse = residuals
    c, acc = q.shape[-2] // 2, lse.dtype
    g = _after(g, lse, cpu)  # the backward's layouts and accumulators wait for the forward
    delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1)
    dsink = sink_grad(sink, lse, delta)  # this device's queries' share
    (qe, ql), own = _chunks(q, k, v, pos, seg, block)
    (ke, kl) = own
    ge, gl = (grad_blocks(g[..., h, :], lse[..., h], delta[..., h], block)
              for h in (slice(0, c), slice(c, 2 * c)))  # fmt: skip
    hop = partial(ring_hop, axis=axis, ways=ways, pack=not cpu)

    def attend(queries, grads, dq, keys, dkv):
        dq, dk, dv = backward_blocks(queries, *grads, dq, keys, scale, causal=False, dkv=dkv)
        return dq, (dk, dv)

    def zeros(like):  # accumulators (in a CPU program: built once the forward is done)
        return _after(jnp.zeros(like.shape, acc), lse, cpu)

    def visit(dqs, held, start):
        """The ``held`` block's dK/dV partial sums ``start`` plus this device's share, and dQ."""
        (dq_e, dq_l), (he, hl), (dkv_e, dkv_l) = dqs, held, start

        def early_keys():  # their early keys: both our query chunks add to its dK/dV
            dq_e2, dkv = attend(qe, ge, dq_e, he, dkv_e)
            dq_l2, dkv = attend(ql, gl, dq_l, he, dkv)
            return (dq_e2, dq_l2), (dkv, dkv_l)

        def late_queries():  # our late queries over both their chunks
            dq_l2, dkv_e2 = attend(ql, gl, dq_l, he, dkv_e)
            dq_l2, dkv_l2 = attend(ql, gl, dq_l2, hl, dkv_l)
            return (dq_e, dq_l2), (dkv_e2, dkv_l2)

        return jax.lax.cond(_from_earlier(held, qe), early_keys, late_queries)

    def ring_step(dqs, held, sending, pass_on: bool):
        """One overlapped hop: ``held`` passed on (unless ``pass_on`` is False: the last
        hop) with ``sending``, this device's partial sum for the block it held before, while
        the block in hand is attended to from zeros; the partial sum that arrives is the
        held block's, added after."""
        passed, arrived = hop((held if pass_on else None, sending))
        blank = tuple((zeros(h[0]),) * 2 for h in held)
        dqs, mine = visit(dqs, held, blank)
        return dqs, passed, add_partials(mine, arrived)

    def serial(carry, _):  # a CPU program's hop: receive, then add to the block's dK/dV
        dqs, held, grads = carry
        held, grads = hop((held, grads))  # a block travels with its dK/dV
        dqs, grads = visit(dqs, held, grads)
        return (dqs, held, grads), None

    def overlapped(carry, _):
        return ring_step(*carry, True), None

    overlap = not cpu and ways > 1
    # our own block: in flight over our early diagonal and late queries (overlapped)
    held = hop(own) if overlap else own
    dq_e, *dkv_e = diagonal_backward(qe, ge, zeros(qe[0]), ke, scale, (zeros(ke[0]),) * 2)
    dq_l, dkv_e = attend(ql, gl, zeros(ql[0]), ke, tuple(dkv_e))
    if not overlap:
        dq_l, *dkv_l = diagonal_backward(ql, gl, dq_l, kl, scale, (zeros(kl[0]),) * 2)
        carry = ((dq_e, dq_l), own, (dkv_e, tuple(dkv_l)))
        ((dq_e, dq_l), _, grads), _ = jax.lax.scan(serial, carry, None, length=ways - 1)
        (dk_e, dv_e), (dk_l, dv_l) = hop(grads) if ways > 1 else grads  # the last hop: home
    else:  # our late diagonal's share of our dK/dV comes last, behind the last hop
        dqs, partial_sum = (dq_e, dq_l), (dkv_e, (zeros(kl[0]),) * 2)
        if ways > 2:  # a loop also for one hop: unrolled, XLA fused the unpacking of
            # neighbouring hops into one fusion, making a hop's work wait for the next transfer
            carry = (dqs, held, partial_sum)
            (dqs, held, partial_sum), _ = jax.lax.scan(overlapped, carry, None, length=ways - 2)
        dqs, _, partial_sum = ring_step(dqs, held, partial_sum, False)
        home = hop(partial_sum)  # the last partial sums, home to their blocks' owners
        dq_l, *dkv_l = diagonal_backward(ql, gl, dqs[1], kl, scale, (zeros(kl[0]),) * 2)
        dq_e, ((dk_e, dv_e), (dk_l, dv_l)) = dqs[0], add_partials(home, (None, tuple(dkv_l)))
    dq = _join((dq_e, dq_l), 3, c)
    dk, dv = _join((dk_e, dk_l), 2, c), _join((dv_e, dv_l), 2, c)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsink


_ring.defvjp(_ring_fwd, _ring_bwd)
