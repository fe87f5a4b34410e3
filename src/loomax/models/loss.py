"""Next-token cross-entropy, with a fused LM-head + softmax that never stores full logits.

Losses are returned as ``(sum, weight)`` pairs so that microbatches and devices can be
reduced exactly: the mean is ``sum / weight`` over everything that was summed.
"""

from __future__ import annotations

from functools import partial

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec as P

from loomax.mesh import current_mesh, mapped_axes
from loomax.models.attention.sequence_layout import context_axes, context_ways, to_layout
from loomax.models.axes import Embed, Position, Vocab
from loomax.models.blocks import pipeline, pipeline_tail, taps
from loomax.models.blocks.buffers import STATE_PREFIX
from loomax.models.blocks.logits_stats import logits_stats, row_blocks
from loomax.models.config import LmModel, soft_cap


def next_token_targets(tokens: NamedArray) -> tuple[NamedArray, NamedArray]:
    """Targets (tokens shifted left by one) and weights (0 at the last position)."""
    Pos = tokens.resolve_axis(Position)
    targets = hax.roll(tokens, -1, Pos)
    weights = (hax.arange(Pos) < Pos.size - 1).astype(jnp.float32).broadcast_axis(tokens.axes)
    return targets, weights


def next_token_loss(
    model: LmModel,
    tokens: NamedArray,
    *,
    block_size: int | None = 4096,
    z_loss_weight: float = 0.0,
    segment_ids: NamedArray | None = None,
    vocab_block_size: int | None = None,
    vocab_multiple: int = 1,
    key: jax.Array | None = None,
    aux_losses: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``(sum of token losses, number of tokens)`` for predicting each next token
    (``next_token_loss_and_metrics`` without the metrics).

    ``block_size`` tokens at a time go through the fused LM head and softmax; ``None``
    computes full logits (the reference path, used in tests); ``vocab_block_size`` also
    splits the vocabulary, so at most ``[block_size, vocab_block_size]`` logits exist;
    ``vocab_multiple`` pads the fused head's rows to a multiple of it (masked out of the
    softmax), which gives the matmuls aligned shapes. ``z_loss_weight > 0`` adds
    ``z_loss_weight * logsumexp(logits)**2`` per token (keeps the softmax normaliser near 1).
    ``segment_ids`` keep attention within packed documents (see ``segment_ids_from_eos``).
    ``key`` (the train step's) drives the model's dropout; None (evaluation) drops nothing.
    With the sequence split over the context axis, tokens, documents, targets and weights
    are put into its zig-zag layout (``models/attention/sequence_layout.py``) before the model runs.
    ``aux_losses`` adds the model's own loss terms (``AuxOutputs.losses``, e.g. MoE balance
    losses), each a per-token mean, so the sum gains ``number of tokens * term``.
    """
    (total, weight), _ = next_token_loss_and_metrics(
        model,
        tokens,
        block_size=block_size,
        z_loss_weight=z_loss_weight,
        segment_ids=segment_ids,
        vocab_block_size=vocab_block_size,
        vocab_multiple=vocab_multiple,
        key=key,
        aux_losses=aux_losses,
    )
    return total, weight


def next_token_loss_and_metrics(
    model: LmModel,
    tokens: NamedArray,
    *,
    block_size: int | None = 4096,
    z_loss_weight: float = 0.0,
    segment_ids: NamedArray | None = None,
    vocab_block_size: int | None = None,
    vocab_multiple: int = 1,
    key: jax.Array | None = None,
    aux_losses: bool = True,
    loss_weights: NamedArray | None = None,
) -> tuple[tuple[jax.Array, jax.Array], dict[str, jax.Array]]:
    """``((sum, number of tokens), metrics)``: ``next_token_loss`` and the model's metrics
    (``AuxOutputs.metrics``; empty for a dense model), as a trainer's loss function returns;
    its state statistics (``AuxOutputs.state``) join them as ``state/<name>`` token means.
    ``loss_weights`` (0/1 per position, as ``tokens``) keep only the predictions they mark
    (chat SFT's loss mask); the count, the mean's normaliser, is then the marked tokens."""
    targets, weights = next_token_targets(tokens)
    if loss_weights is not None:
        weights = weights * loss_weights.astype(jnp.float32)
    # a sequence split over the context axis is laid out zig-zag; the loss, a sum, needs no undoing
    tokens, targets, weights = to_layout(tokens), to_layout(targets), to_layout(weights)
    if segment_ids is not None:
        segment_ids = to_layout(segment_ids)
    cap = model.final_logit_softcap

    def fused(h, w, t, m):
        if cap is not None:
            return capped_cross_entropy_sum(h, w, t, m, block_size, z_loss_weight, cap)
        settings = (block_size, z_loss_weight, vocab_block_size, vocab_multiple)
        return fused_cross_entropy_sum(h, w, t, m, *settings)

    def plain(h, w, t, m):
        return plain_cross_entropy_sum(h, w, t, m, z_loss_weight, cap)

    ce = plain if block_size is None else fused
    tail = pipeline_tail.loss_tail(model, ce, targets, weights, pipeline.stage_count(), aux_losses)
    with pipeline_tail.tail_context(tail):  # 1F1B & co: the stack runs the loss per microbatch
        hidden, aux = model.hidden_states_and_aux(tokens, segment_ids=segment_ids, key=key)
    w = model.lm_head_weight().rearrange((Vocab, Embed)).array
    hidden = hidden.rearrange((..., Position, Embed))
    h = hidden.array.reshape(-1, w.shape[1])
    t = targets.array.reshape(-1)
    m = weights.rearrange(targets.axes).array.reshape(-1)
    if taps.active():
        taps.record("logits", logits_stats(h, w, block_size or h.shape[0]))
    total = None if tail is None else pipeline_tail.loss_of(tail)
    if total is not None:
        pass
    elif block_size is not None and (context_ways() > 1 or _rows_split(hidden.array.shape[0])):
        rows = [x.reshape(-1, hidden.resolve_axis(Position).size, *x.shape[1:]) for x in (h, t, m)]
        total = per_device_sum(fused, w.astype(h.dtype), *rows)
    else:
        total = ce(h, w.astype(h.dtype), t, m)
    count = jnp.sum(m)
    if aux_losses:
        for term in aux.losses.values():
            total = total + count * term.astype(total.dtype)
        for term in aux.side_losses.values():  # the gradient only: the value adds exactly 0
            term = term.astype(total.dtype)
            total = total + count * (term - jax.lax.stop_gradient(term))
    state = {f"{STATE_PREFIX}{k}": (v * count, count) for k, v in aux.state.items()}
    return (total, count), {**aux.metrics, **state}


def _rows_split(batch_rows: int) -> bool:
    """Whether the mesh in context splits the batch's rows over more than one device. The
    fused loss then runs per device (``per_device_sum``): its scan over token blocks, in the
    global view, would walk every device's blocks on every device, fetching each block with an
    all-reduce of the whole batch's hidden states (the compiled v5p program of
    ``config/mixtral_8x7b.yaml`` did: a ``[1024, 2048, 4096]`` all-reduce per block)."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return False
    names = _names(mapped_axes(mesh, "batch", batch_rows))
    return any(mesh.shape[n] > 1 for n in names)


def per_device_sum(fn, w: jax.Array, *rows: jax.Array) -> jax.Array:
    """``fn(*flattened rows, w)`` of each device's own tokens, summed over the devices.

    ``rows`` are ``[B, T, ...]`` arrays laid out as the compute mapping splits ``batch`` and
    ``position`` (over the context axes): each device runs ``fn`` on its own slots, so a
    sequence split over the context axis is never gathered (the fused loss's scan over
    token blocks would otherwise gather the hidden states); ``w`` is whole on every device.
    """
    mesh, ctx = current_mesh(), context_axes()
    batch = mapped_axes(mesh, "batch", rows[0].shape[0], keep_trivial=True)
    ctx_entry = ctx[0] if len(ctx) == 1 else ctx
    split = tuple(a for part in (batch, ctx_entry) for a in _names(part))

    def local(w, *rows):
        flat = [x.reshape(-1, *x.shape[2:]) for x in rows]
        return jax.lax.psum(fn(flat[0], w, *flat[1:]), split)

    specs = [P(batch, ctx_entry)] * len(rows)
    # check_vma off: DiLoCo runs the step under ``jax.vmap(spmd_axis_name="replica")``, which
    # makes the rows vary over ``replica`` too, an axis this shard_map does not name (JAX's
    # check then refuses the scans' carries); w's gradient is summed by the psum's transpose
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), *specs), out_specs=P(), check_vma=False)(
        w, *rows
    )


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _acc(dtype) -> jnp.dtype:
    """Accumulation dtype: at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def plain_cross_entropy_sum(
    h: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    z_loss_weight: float = 0.0,
    softcap: float | None = None,
) -> jax.Array:
    """The weighted cross-entropy sum (plus z-loss) with the whole logits matrix in memory:
    the plain form the fused and blocked losses must equal (logits soft-capped by ``softcap``)."""
    logits = soft_cap(jnp.dot(h, w.T, preferred_element_type=_acc(h.dtype)), softcap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - picked + z_loss_weight * lse**2) * weights)


def capped_cross_entropy_sum(
    h: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    block_size: int,
    z_loss_weight: float,
    softcap: float,
) -> jax.Array:
    """``plain_cross_entropy_sum`` with soft-capped logits, ``block_size`` tokens at a time:
    each block is rematerialized in the backward pass (plain autodiff, not the fused
    gradient), so at most ``[block_size, vocab]`` logits exist; no vocabulary blocks."""
    block = min(block_size, h.shape[0])

    @jax.checkpoint
    def one(total, xs):
        h_b, t_b, m_b = xs
        return total + plain_cross_entropy_sum(h_b, w, t_b, m_b, z_loss_weight, softcap), None

    xs = (
        row_blocks(h, block),
        row_blocks(targets, block),
        row_blocks(weights, block),
    )  # padding: weight 0
    total, _ = jax.lax.scan(one, _zeros_like(h, (), _acc(h.dtype)), xs)
    return total


def _zeros_like(rows: jax.Array, shape, dtype) -> jax.Array:
    """Zeros of ``shape`` and ``dtype`` for a scan's first carry: varying, inside
    ``shard_map``, over the mesh axes ``rows`` (the tokens' rows) vary over, as the carries
    the scan's body returns from them (``jnp.zeros`` would be invariant: a type error)."""
    return jnp.zeros_like(rows, dtype=dtype, shape=shape)


def _padded_rows(w: jax.Array, multiple: int) -> jax.Array:
    """``w [V, d]`` with zero rows appended up to a multiple of ``multiple`` rows."""
    pad = (-w.shape[0]) % multiple
    return jnp.pad(w, ((0, pad), (0, 0))) if pad else w


def _head_logits(h_b: jax.Array, w: jax.Array, vocab: int) -> jax.Array:
    """``h_b @ w.T`` in the accumulation dtype, the columns past ``vocab`` (padding) at -inf."""
    logits = jnp.dot(h_b, w.T, preferred_element_type=_acc(h_b.dtype))
    if w.shape[0] == vocab:
        return logits
    return jnp.where(jnp.arange(w.shape[0]) < vocab, logits, -jnp.inf)


def _block_loss(h_b, w, t_b, m_b, z_loss_weight, vocab):
    logits = _head_logits(h_b, w, vocab)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_b[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - picked + z_loss_weight * lse**2) * m_b)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def fused_cross_entropy_sum(
    h: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    block_size: int,
    z_loss_weight: float = 0.0,
    vocab_block_size: int | None = None,
    vocab_multiple: int = 1,
) -> jax.Array:
    """``sum_i weights_i * (CE(h_i @ w.T, targets_i) + z * lse_i**2)`` over token blocks.

    ``h`` is ``[tokens, embed]``, ``w`` is ``[vocab, embed]``; at most ``[block_size,
    vocab]`` logits exist at a time, or ``[block_size, vocab_block_size]`` with vocabulary
    blocks (an online logsumexp over them, then a second pass for the gradient). Under
    differentiation the gradient is computed block by block in the forward pass, so
    neither the logits nor the softmax are ever stored whole. Without vocabulary blocks,
    ``w`` is padded with zero rows to a multiple of ``vocab_multiple`` (their logits masked).
    """
    return _fused_forward(
        h, w, targets, weights, block_size, z_loss_weight, vocab_block_size, vocab_multiple
    )


def _vocab_chunks(w: jax.Array, vocab_block: int):
    """``w [V, d] -> [n, vb, d]`` (zero rows padding the last chunk) and the chunks' row ids."""
    vb = min(vocab_block, w.shape[0])
    chunks = row_blocks(w, vb)
    return chunks, jnp.arange(chunks.shape[0] * vb).reshape(chunks.shape[0], vb)


def _chunked_lse_and_picked(h_b, chunks, ids, vocab, t_b):
    """Per token: logsumexp of the logits and the target's logit, one vocabulary chunk at a time."""
    acc = _acc(h_b.dtype)
    low = jnp.finfo(acc).min

    def body(carry, xs):
        peak, norm, picked = carry
        w_c, id_c = xs
        logits = jnp.dot(h_b, w_c.T, preferred_element_type=acc)
        logits = jnp.where(id_c[None, :] < vocab, logits, low)
        new = jnp.maximum(peak, jnp.max(logits, axis=-1))
        norm = norm * jnp.exp(peak - new) + jnp.sum(jnp.exp(logits - new[:, None]), axis=-1)
        picked = picked + jnp.sum(jnp.where(id_c[None, :] == t_b[:, None], logits, 0.0), axis=-1)
        return (new, norm, picked), None

    n = h_b.shape[0]
    zero = _zeros_like(h_b, (n,), acc)
    init = (zero + low, zero, zero)
    (peak, norm, picked), _ = jax.lax.scan(body, init, (chunks, ids))
    return peak + jnp.log(norm), picked


def _chunked_grads(h_b, chunks, ids, vocab, t_b, m_b, lse, z_loss_weight):
    """``(dh_b, dw)`` of the block's loss, recomputing each vocabulary chunk's softmax from ``lse``."""
    acc = _acc(h_b.dtype)
    scale = (m_b * (1 + 2 * z_loss_weight * lse))[:, None]

    def body(dh, xs):
        w_c, id_c = xs
        logits = jnp.dot(h_b, w_c.T, preferred_element_type=acc)
        probs = jnp.where(id_c[None, :] < vocab, jnp.exp(logits - lse[:, None]), 0.0)
        is_target = id_c[None, :] == t_b[:, None]
        dlogits = (probs * scale - jnp.where(is_target, m_b[:, None], 0.0)).astype(h_b.dtype)
        dh = dh + jnp.dot(dlogits, w_c, preferred_element_type=acc)
        return dh, jnp.dot(dlogits.T, h_b, preferred_element_type=acc)

    dh, dw = jax.lax.scan(body, _zeros_like(h_b, h_b.shape, acc), (chunks, ids))
    return dh.astype(h_b.dtype), dw.reshape(-1, h_b.shape[1])[:vocab]


def _fused_forward(
    h, w, targets, weights, block_size, z_loss_weight, vocab_block_size=None, vocab_multiple=1
):
    block, vocab = min(block_size, h.shape[0]), w.shape[0]
    if vocab_block_size is not None:
        chunks, ids = _vocab_chunks(w, vocab_block_size)
    else:
        w = _padded_rows(w, vocab_multiple)

    def body(total, xs):
        h_b, t_b, m_b = xs
        if vocab_block_size is None:
            return total + _block_loss(h_b, w, t_b, m_b, z_loss_weight, vocab), None
        lse, picked = _chunked_lse_and_picked(h_b, chunks, ids, w.shape[0], t_b)
        return total + jnp.sum((lse - picked + z_loss_weight * lse**2) * m_b), None

    xs = (row_blocks(h, block), row_blocks(targets, block), row_blocks(weights, block))
    total, _ = jax.lax.scan(body, _zeros_like(h, (), _acc(h.dtype)), xs)
    return total


def _fused_fwd(h, w, targets, weights, block_size, z_loss_weight, vocab_block_size, vocab_multiple):
    block, vocab = min(block_size, h.shape[0]), w.shape[0]
    acc = _acc(h.dtype)
    if vocab_block_size is not None:
        chunks, ids = _vocab_chunks(w, vocab_block_size)
    head = w if vocab_block_size is not None else _padded_rows(w, vocab_multiple)

    def body(dw, xs):
        h_b, t_b, m_b = xs
        if vocab_block_size is not None:
            lse, picked = _chunked_lse_and_picked(h_b, chunks, ids, vocab, t_b)
            dh_b, dw_b = _chunked_grads(h_b, chunks, ids, vocab, t_b, m_b, lse, z_loss_weight)
            return dw + dw_b, (dh_b, lse - picked + z_loss_weight * lse**2)
        logits = _head_logits(h_b, head, vocab)
        peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        exp = jnp.exp(logits - peak)  # the only pass of exp over [block, vocab]
        norm = jnp.sum(exp, axis=-1, keepdims=True)
        picked = jnp.take_along_axis(logits, t_b[:, None], axis=-1)
        lse = peak + jnp.log(norm)
        token_loss = (lse - picked + z_loss_weight * lse**2)[:, 0]
        is_target = jnp.arange(head.shape[0], dtype=t_b.dtype)[None, :] == t_b[:, None]
        softmax_scale = m_b[:, None] * (1 + 2 * z_loss_weight * lse) / norm
        dlogits = (exp * softmax_scale - jnp.where(is_target, m_b[:, None], 0.0)).astype(h.dtype)
        dh_b = jnp.dot(dlogits, head, preferred_element_type=acc).astype(h.dtype)
        dw = dw + jnp.dot(dlogits.T, h_b, preferred_element_type=acc)
        return dw, (dh_b, token_loss)

    xs = (row_blocks(h, block), row_blocks(targets, block), row_blocks(weights, block))
    dw, (dh, token_loss) = jax.lax.scan(body, _zeros_like(h, head.shape, acc), xs)
    dw = dw[:vocab]
    dh = dh.reshape(-1, h.shape[1])[: h.shape[0]]
    token_loss = token_loss.reshape(-1)[: h.shape[0]]
    total = jnp.sum(token_loss * weights)
    return total, (dh, dw.astype(w.dtype), targets, token_loss)


def _fused_bwd(block_size, z_loss_weight, vocab_block_size, vocab_multiple, residuals, g):
    dh, dw, targets, token_loss = residuals
    zero_targets = jnp.zeros(targets.shape, jax.dtypes.float0)
    return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), zero_targets, token_loss * g)


fused_cross_entropy_sum.defvjp(_fused_fwd, _fused_bwd)
