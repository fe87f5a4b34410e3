"""The ``blockwise`` attention backend: flash-style attention in pure JAX.

An online softmax over key blocks, with a custom backward pass that recomputes the scores
block by block, so memory is O(seq), never O(seq^2), forward and backward.

``flash_attention`` is self-attention over positions ``0..T-1``; ``flash_attention_at``
takes the queries' and keys' positions and segments apart (queries and keys of different
lengths, positions in any order), which the context-parallel attention uses for each
device's part of a split sequence; ``block_forward`` / ``block_backward`` are its two
halves, returning the log-sum-exp and taking it back, so partial results can be combined.
Key blocks wholly in a query block's future, or (with a sliding ``window``) wholly behind the
window of its earliest query, are skipped, not masked: their scores are never computed.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loomax.models.attention.sinks import sink_grad, sink_state


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype scores and softmax are computed in: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def visible_mask(q_pos, k_pos, q_seg, k_seg, window: int | None = None):
    """``[B or 1, 1, 1, Tq, Tk]`` boolean: causal, within ``window`` (a query sees the keys
    fewer than ``window`` positions back, itself included) when given, and the same segment
    when segments are given."""
    behind = q_pos[:, None] - k_pos[None, :]
    mask = behind >= 0
    if window is not None:
        mask = mask & (behind < window)
    mask = mask[None, None, None]
    if q_seg is not None:
        mask = mask & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    return mask


def block_at(tree, i):
    """Block ``i`` (traced) of each leaf of ``tree`` (blocks along the leading axis)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def put_block(tree, i, value):
    """``tree`` with block ``i`` of each leaf replaced by ``value`` (in place in a loop)."""
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0), tree, value)


def _split_blocks(x, block, axis):
    """``[..., n * block, ...] -> [n, ..., block, ...]`` along ``axis``."""
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // block, block, *shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def merge_blocks(x, axis):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def _pad_to(x, multiple, axis, value=0):
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


LATE = np.iinfo(np.int32).max
"""Position of padding keys: later than every query, so no query sees one."""


def flash_attention(
    q, k, v, seg, scale: float, block: int, window: int | None = None,
    softcap: float | None = None, sink=None,
):  # fmt: skip
    """Causal attention by blocks with an online softmax; O(seq) memory forward and backward.

    ``q`` is ``[B, K, G, T, D]``, ``k``/``v`` are ``[B, K, T, D]``, ``seg`` is ``[B, T]``;
    ``window``: sliding-window attention (``visible_mask``); ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` (Gemma 2); ``sink [K, G]``: attention sinks
    (``models/attention/sinks.py``).
    """
    pos = jnp.arange(q.shape[-2], dtype=jnp.int32)
    return flash_attention_at(q, k, v, pos, pos, seg, seg, scale, block, window, softcap, sink)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def flash_attention_at(
    q, k, v, q_pos, k_pos, q_seg, k_seg, scale: float, block: int, window=None, softcap=None,
    sink=None,
):  # fmt: skip
    """Causal attention of ``q`` (``[B, K, G, Tq, D]`` at positions ``q_pos [Tq]``, segments
    ``q_seg [B, Tq]``) over ``k``/``v`` (``[B, K, Tk, D]``, ``k_pos [Tk]``, ``k_seg [B, Tk]``):
    a query sees the keys at or before its position in its own segment (and within
    ``window``), and each head's ``sink [K, G]`` when given."""
    out, _ = block_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block, window, softcap, sink)
    return out.astype(q.dtype)


def query_blocks(q, q_pos, q_seg, block):
    """``q [B, K, G, T, D]``, its positions and segments cut into blocks of ``block`` queries
    (padded: padding sees no key)."""
    q = _split_blocks(_pad_to(q, block, 3), block, 3)
    q_seg = _split_blocks(_pad_to(q_seg, block, 1, value=-1), block, 1)
    return q, _split_blocks(_pad_to(q_pos, block, 0, value=-1), block, 0), q_seg


def key_blocks(k, v, k_pos, k_seg, block):
    """``k``/``v [B, K, T, D]``, their positions and segments cut into blocks of ``block`` keys
    (padded: no query sees padding)."""
    k, v = _pad_to(k, block, 2), _pad_to(v, block, 2)
    k_seg = _split_blocks(_pad_to(k_seg, block, 1, value=-1), block, 1)
    k_pos = _split_blocks(_pad_to(k_pos, block, 0, value=LATE), block, 0)
    return _split_blocks(k, block, 2), _split_blocks(v, block, 2), k_pos, k_seg


def _block_scores(q_b, k_b, qp, kp, qs, ks, scale, window, softcap=None, causal=True):
    acc = acc_dtype(q_b.dtype)
    s = jnp.einsum("bkgqd,bksd->bkgqs", q_b, k_b, preferred_element_type=acc) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if causal:
        return s, visible_mask(qp, kp, qs, ks, window)
    # every real query sees every real key of its segment: only padding is masked
    mask = ((qp >= 0)[:, None] & (kp != LATE)[None, :])[None, None, None]
    if qs is not None:
        mask = mask & (qs[:, None, None, :, None] == ks[:, None, None, None, :])
    return s, mask


def _any_visible(qp, kp, window: int | None = None):
    """Whether some key of a block can be visible to some query of a block (else skip it):
    not all in the future, nor (with ``window``) all behind the earliest query's window."""
    visible = jnp.min(kp) <= jnp.max(qp)
    if window is not None:  # padding (keys LATE, queries -1) does not count
        last_key = jnp.max(jnp.where(kp == LATE, -1, kp))
        first_query = jnp.min(jnp.where(qp < 0, LATE, qp))
        visible = visible & (last_key > first_query - window)
    return visible


def tie_to_queries(q_b, *rest):
    """``(q_b, *rest)`` through an optimisation barrier, so that JAX sees the block's mask
    inputs (segments, positions) as depending on the queries.

    Inside a differentiated ``lax.scan`` over layers the segments are loop-invariant, and
    JAX hoists whatever depends only on them out of the layer loop, evaluated for every
    (query block, key block) pair at once: the masks and the constants they select
    between, O(seq^2) stacked buffers (5.3 GiB at 4,096 positions) where flash attention
    should need O(seq). The barrier keeps that work inside the blocks, where it is cheap.
    """
    return jax.lax.optimization_barrier((q_b, *rest))


def softmax_step(carry, pair, scale: float, window=None, softcap=None, causal=True):
    """The online softmax ``carry`` (running max, sum, output) of a query block carried on
    over a key block: ``pair`` is ``(q_b, qp, qs, k_b, v_b, kp, ks)``."""
    (q_b, qp, qs, k_b, v_b, kp, ks), (m, total, o) = pair, carry
    acc = acc_dtype(q_b.dtype)
    s, mask = _block_scores(q_b, k_b, qp, kp, qs, ks, scale, window, softcap, causal)
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, jnp.finfo(acc).min), axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    total = total * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v_b.dtype), v_b, preferred_element_type=acc)
    return m_new, total, o * corr[..., None] + pv


def _key_grad(x, t):
    """``sum over (g, q) of t[b,k,g,q,s] x[b,k,g,q,d]`` as ``[B, K, S, D]``: x^T t, then its
    (small) transpose, so the score-sized ``t`` needs no transposed copy."""
    return jnp.swapaxes(jnp.einsum("bkgqd,bkgqs->bkds", x, t), -1, -2)


def grad_step(dq, pair, grads, scale: float, window=None, softcap=None, causal=True):
    """``(dq, dk_b, dv_b)``: a query block's ``dq`` carried on over a key block, and that key
    block's dK/dV from these queries; ``pair`` as in ``softmax_step``, ``grads`` the query
    block's ``(g_b, l_b, d_b)`` (``grad_blocks``)."""
    (q_b, qp, qs, k_b, v_b, kp, ks), (g_b, l_b, d_b) = pair, grads
    acc = acc_dtype(q_b.dtype)
    s, mask = _block_scores(q_b, k_b, qp, kp, qs, ks, scale, window, softcap, causal)
    p = jnp.where(mask, jnp.exp(s - l_b[..., None]), 0.0)
    dv_b = _key_grad(g_b.astype(acc), p)
    dp = jnp.einsum("bkgqd,bksd->bkgqs", g_b.astype(acc), v_b.astype(acc))
    ds = p * (dp - d_b[..., None]) * scale
    if softcap is not None:  # d(cap * tanh(x / cap)) = 1 - (capped / cap)^2
        ds = ds * (1 - jnp.square(s / softcap))
    dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, k_b.astype(acc))
    dk_b = _key_grad(q_b.astype(acc), ds)
    return dq, dk_b, dv_b


def forward_state(queries, sink=None):
    """The online softmax's start for blocked ``queries``: (running max, sum, output); from
    each head's ``sink [K, G]`` when given (``sinks.sink_state``)."""
    qb = queries[0]
    acc = acc_dtype(qb.dtype)
    m, total = sink_state(sink, qb.shape[:-1], acc, jnp.finfo(acc).min)
    return m, total, jnp.zeros(qb.shape, acc)


def forward_blocks(queries, state, keys, scale: float, window=None, softcap=None, causal=True):
    """The online softmax ``state`` of blocked ``queries`` (``query_blocks``) carried on over
    blocked ``keys`` (``key_blocks``): attention over several key parts in turn equals
    attention over them all. ``causal=False``: the caller knows every key precedes every
    query (no causal mask, no skip test; segments still apply)."""
    qb, qpb, qsb = queries
    kb, vb, kpb, ksb = keys

    def per_query_block(xs):
        (q_b, qs, qp), init = tie_to_queries(*xs[:3]), xs[3]

        def per_key_block(carry, ys):
            k_b, v_b, ks, kp = ys

            def compute(carry):
                pair = (q_b, qp, qs, k_b, v_b, kp, ks)
                return softmax_step(carry, pair, scale, window, softcap, causal)

            if not causal:
                return compute(carry), None
            carry = jax.lax.cond(_any_visible(qp, kp, window), compute, lambda c: c, carry)
            return carry, None

        state, _ = jax.lax.scan(per_key_block, init, (kb, vb, ksb, kpb))
        return state

    return jax.lax.map(per_query_block, (qb, qsb, qpb, state))


def finish(state):
    """``(out, lse)`` blocks of a finished online softmax ``state``."""
    m, total, o = state
    total = jnp.where(total == 0, 1.0, total)
    return o / total[..., None], m + jnp.log(total)


def block_forward(
    q, k, v, q_pos, k_pos, q_seg, k_seg, scale: float, block: int, window=None, softcap=None,
    sink=None,
):  # fmt: skip
    """``(out, lse)``: the attention output in the accumulation dtype (``[B, K, G, Tq, D]``)
    and the log-sum-exp of each query's visible scores and ``sink`` (``[B, K, G, Tq]``; a
    query that sees no key and no sink gets the dtype's lowest value, and zeros)."""
    Tq = q.shape[-2]
    queries = query_blocks(q, q_pos, q_seg, min(block, Tq))
    keys = key_blocks(k, v, k_pos, k_seg, min(block, k.shape[-2]))
    state = forward_blocks(queries, forward_state(queries, sink), keys, scale, window, softcap)
    out, lse = finish(state)
    return merge_blocks(out, 3)[..., :Tq, :], merge_blocks(lse, 3)[..., :Tq]


def backward_blocks(
    queries, gb, lb, db, dq, keys, scale: float, window=None, softcap=None, causal=True,
    dkv=None,
):  # fmt: skip
    """``(dq, dk, dv)`` blocks, the accumulation dtype: ``dq`` (blocks like ``queries``)
    carried on over blocked ``keys``, and those keys' dK/dV, for the attention whose (global)
    log-sum-exp per query is ``lb`` and ``db = sum(g * out, -1)`` (``g``'s blocks ``gb``);
    ``causal`` as in ``forward_blocks``. ``dkv``: the keys' ``(dk, dv)`` blocks so far, added
    to (default zeros). ``dq``, dK and dV are updated in place, a block at a time: no
    per-block stacks of partial gradients, no second copy of ``dq``."""
    qb, qpb, qsb = queries
    kb, vb, kpb, ksb = keys
    acc = acc_dtype(qb.dtype)

    def per_query_block(carry, i):
        dq, dk, dv = carry
        q_b, qs, qp, g_b, l_b, d_b, dq_b = block_at((qb, qsb, qpb, gb, lb, db, dq), i)

        def per_key_block(carry, j):
            dq_b, dk, dv = carry
            k_b, v_b, ks, kp = block_at((kb, vb, ksb, kpb), j)

            def compute(dq_b):
                pair = (q_b, qp, qs, k_b, v_b, kp, ks)
                return grad_step(dq_b, pair, (g_b, l_b, d_b), scale, window, softcap, causal)

            def skip(dq_b):
                zeros = jnp.zeros(k_b.shape, acc)
                return dq_b, zeros, zeros

            if not causal:
                dq_b, dk_b, dv_b = compute(dq_b)
            else:
                visible = _any_visible(qp, kp, window)
                dq_b, dk_b, dv_b = jax.lax.cond(visible, compute, skip, dq_b)
            dk, dv = (put_block(a, j, block_at(a, j) + b) for a, b in ((dk, dk_b), (dv, dv_b)))
            return (dq_b, dk, dv), None

        (dq_b, dk, dv), _ = jax.lax.scan(per_key_block, (dq_b, dk, dv), jnp.arange(kb.shape[0]))
        return (put_block(dq, i, dq_b), dk, dv), None

    if dkv is None:
        dkv = (jnp.zeros(kb.shape, acc),) * 2
    (dq, dk, dv), _ = jax.lax.scan(per_query_block, (dq, *dkv), jnp.arange(qb.shape[0]))
    return dq, dk, dv


def block_backward(
    q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block, g, lse, delta, window=None, softcap=None
):
    """``(dq, dk, dv)`` in the accumulation dtype, of the attention whose (global) log-sum-exp
    per query is ``lse`` and ``delta = sum(g * out, -1)``, for the keys given: summed over
    the key parts a query sees, these are the whole gradients."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    queries = query_blocks(q, q_pos, q_seg, min(block, Tq))
    keys = key_blocks(k, v, k_pos, k_seg, min(block, Tk))
    gb, lb, db = grad_blocks(g, lse, delta, min(block, Tq))
    dq0 = jnp.zeros(queries[0].shape, acc_dtype(q.dtype))
    dq, dk, dv = backward_blocks(queries, gb, lb, db, dq0, keys, scale, window, softcap)
    dq = merge_blocks(dq, 3)[..., :Tq, :]
    return dq, merge_blocks(dk, 2)[..., :Tk, :], merge_blocks(dv, 2)[..., :Tk, :]


def grad_blocks(g, lse, delta, block: int):
    """``g``, ``lse`` and ``delta`` in query blocks (as ``query_blocks`` cuts ``q``)."""
    return tuple(_split_blocks(_pad_to(x, block, 3), block, 3) for x in (g, lse, delta))


def _flash_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block, window, softcap, sink):
    out, lse = block_forward(
        q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block, window, softcap, sink
    )
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse, sink)


def _flash_bwd(scale, block, window, softcap, residuals, g):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse, sink = residuals
    delta = jnp.sum(g.astype(lse.dtype) * out.astype(lse.dtype), axis=-1)  # [B, K, G, Tq]
    dq, dk, dv = block_backward(
        q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block, g, lse, delta, window, softcap
    )
    dsink = None if sink is None else sink_grad(sink, lse, delta)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None,
            dsink)  # fmt: skip


flash_attention_at.defvjp(_flash_fwd, _flash_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def flash_attention_with_max(q, k, v, seg, scale: float, block: int, window=None):
    """``(flash_attention(...), peak)``: the output and each head's largest visible score
    ``[B, K, G]`` (the online softmax's running max, read at the end; no gradient flows
    through it), for QK-clip (``models/attention/max_logits.py``)."""
    return _with_max_fwd(q, k, v, seg, scale, block, window)[0]


def _with_max_fwd(q, k, v, seg, scale, block, window):
    Tq = q.shape[-2]
    pos = jnp.arange(Tq, dtype=jnp.int32)
    queries = query_blocks(q, pos, seg, min(block, Tq))
    keys = key_blocks(k, v, pos, seg, min(block, Tq))
    state = forward_blocks(queries, forward_state(queries), keys, scale, window)
    out, lse = finish(state)
    out, lse = merge_blocks(out, 3)[..., :Tq, :].astype(q.dtype), merge_blocks(lse, 3)[..., :Tq]
    peak = jnp.max(state[0], axis=(0, -1))  # running max [blocks, B, K, G, block]
    return (out, peak), (q, k, v, pos, pos, seg, seg, out, lse, None)


def _with_max_bwd(scale, block, window, residuals, g):
    dq, dk, dv, *_ = _flash_bwd(scale, block, window, None, residuals, g[0])
    return dq, dk, dv, None


flash_attention_with_max.defvjp(_with_max_fwd, _with_max_bwd)
