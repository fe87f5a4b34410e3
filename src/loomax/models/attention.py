"""Causal self-attention on named axes, shared by every model."""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.models.axes import Heads, HeadSize, KeyPosition, Position

QUERY_BLOCK = 128
"""Queries are processed in blocks of this many positions; each block only sees keys up to
its own end, so the fully masked part of the causal square is never computed."""


def causal_attention(q: NamedArray, k: NamedArray, v: NamedArray) -> NamedArray:
    """Scaled dot-product self-attention with a causal mask.

    ``q`` has axes ``(..., position, heads, head_size)``; ``k`` and ``v`` the same with
    ``key_position`` in place of ``position`` (and the same length: self-attention).
    Scores and softmax are in at least float32; the result has ``q``'s axes and dtype.
    """
    batch_axes = [a for a in q.axes if a.name not in (Position, Heads, HeadSize)]
    Pos, H, D = q.resolve_axis(Position), q.resolve_axis(Heads), q.resolve_axis(HeadSize)
    if k.resolve_axis(KeyPosition).size != Pos.size:
        raise ValueError("causal_attention is self-attention: key_position must match position")
    # heads before positions: [batch..., heads, position, head_size] is much faster on CPU
    order = (*batch_axes, H, Pos, D)
    qa = q.rearrange(order).array
    ka = k.rearrange((*batch_axes, H, k.resolve_axis(KeyPosition), D)).array
    va = v.rearrange((*batch_axes, H, v.resolve_axis(KeyPosition), D)).array
    out = _blocked_causal(qa * jnp.asarray(1 / math.sqrt(D.size), qa.dtype), ka, va)
    return hax.named(out, order).rearrange(q.axes)


def _blocked_causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    seq = q.shape[-2]
    block = min(QUERY_BLOCK, seq)
    outs = []
    for start in range(0, seq, block):
        stop = min(start + block, seq)
        outs.append(_attend(q[..., start:stop, :], k[..., :stop, :], v[..., :stop, :], start))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, q_start: int) -> jax.Array:
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=acc)
    visible = (q_start + jnp.arange(q.shape[-2]))[:, None] >= jnp.arange(k.shape[-2])[None, :]
    scores = jnp.where(visible, scores, jnp.finfo(acc).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...qk,...kd->...qd", weights, v)
