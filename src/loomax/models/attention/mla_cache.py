"""The MLA decode cache and the absorbed attention that reads it.

Multi-head latent attention (``mla.py``) derives every head's key and value from one
compressed latent per token (``kv_lora`` values) plus one rotary key shared by all heads
(``qk_rope`` values). Decoding therefore caches only those two per token and never forms
per-head keys or values: the key up-projection is absorbed into the query (a head's query
``q_nope`` becomes ``W_uk^T q_nope`` in latent space, so its score against token ``s`` is
``q_latent . c_s + q_rope . k_rope_s``) and the value up-projection into the output (the
head's softmax-weighted latent ``sum_s p_s c_s`` goes through ``W_uv`` before ``o_proj``).
In DeepSeek-V3's shape a token costs 512 + 64 = 576 cached values against a Llama-style
cache's 2 x 128 heads x 128 (1/57).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from loomax.models.attention.flash import acc_dtype
from loomax.models.axes import Heads, HeadSize, KeyPosition, Position

KvLora = "kv_lora"
"""Axis of the compressed key/value latent (``kv_lora_rank``)."""
QkNope = "qk_nope"
"""Axis of the non-rotary part of a head's query and key (``qk_nope_head_dim``)."""
VHead = "v_head"
"""Axis of a head's value (``v_head_dim``)."""


class MlaCache(eqx.Module):
    """What MLA decoding keeps per token: ``latent`` (axes ``([layers,] ..., key_position,
    kv_lora)``, after its RMSNorm) and ``k_rope`` (``(..., key_position, head_size)``, the
    shared rotary key, already rotated)."""

    latent: NamedArray
    k_rope: NamedArray


def init_mla_cache(
    batch_axes: tuple[Axis, ...],
    max_len: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype,
    layers: Axis | None = None,
) -> MlaCache:
    """An empty cache for ``max_len`` positions (with a leading ``layers`` axis when given)."""
    lead = (layers,) if layers is not None else ()
    slots = (*lead, *batch_axes, Axis(KeyPosition, max_len))
    return MlaCache(
        hax.zeros((*slots, Axis(KvLora, kv_lora_rank)), dtype),
        hax.zeros((*slots, Axis(HeadSize, qk_rope_head_dim)), dtype),
    )


def cache_bytes_per_token(cache, sequences: int = 1) -> float:
    """Bytes the cache's own arrays hold per cached position of one sequence (all layers
    together): any cache of named arrays with a ``key_position`` axis (``MlaCache``,
    ``KvCache``) holding ``sequences`` sequences."""
    leaves = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, NamedArray))
    slots = leaves[0].resolve_axis(KeyPosition).size
    total = sum(x.array.size * x.array.dtype.itemsize for x in leaves)
    return total / (slots * sequences)


def absorbed_attention(
    q_nope: NamedArray,
    q_rope: NamedArray,
    latent: NamedArray,
    k_rope: NamedArray,
    w_uk: NamedArray,
    w_uv: NamedArray,
    cache: MlaCache,
    start: jax.Array,
    scale: float,
) -> tuple[NamedArray, MlaCache]:
    """Causal attention of new positions ``start, start + 1, ...`` over the cached latents,
    with the up-projections absorbed: returns ``(out (..., position, heads, v_head), cache)``.

    ``q_nope`` ``(..., position, heads, qk_nope)`` and ``q_rope`` ``(..., position, heads,
    head_size)`` are the queries (rotated); ``latent`` ``(..., position, kv_lora)`` and
    ``k_rope`` ``(..., position, head_size)`` the new tokens' cache entries, written at
    ``start``; ``w_uk`` ``(heads, qk_nope, kv_lora)`` and ``w_uv`` ``(heads, v_head, kv_lora)``
    the two halves of ``kv_b_proj``; ``scale`` multiplies the scores.
    """
    new_latent = latent.rename({Position: KeyPosition}).rearrange(cache.latent.axes)
    new_rope = k_rope.rename({Position: KeyPosition}).rearrange(cache.k_rope.axes)
    cache = MlaCache(
        hax.updated_slice(cache.latent, {KeyPosition: start}, new_latent),
        hax.updated_slice(cache.k_rope, {KeyPosition: start}, new_rope),
    )
    acc = acc_dtype(q_nope.dtype)
    q_latent = hax.dot(q_nope, w_uk.astype(q_nope.dtype), axis=QkNope)  # absorbs W_uk
    scores = hax.dot(q_latent, cache.latent, axis=KvLora, preferred_element_type=acc)
    scores = scores + hax.dot(q_rope, cache.k_rope, axis=HeadSize, preferred_element_type=acc)
    Pos, Keys = q_nope.resolve_axis(Position), cache.latent.resolve_axis(KeyPosition)
    visible = hax.arange(Keys).broadcast_axis(Pos) <= hax.arange(Pos) + start
    scores = hax.where(visible, scores * scale, jnp.finfo(acc).min)
    weights = hax.nn.softmax(scores, axis=KeyPosition).astype(cache.latent.dtype)
    context = hax.dot(weights, cache.latent, axis=KeyPosition)  # (..., position, heads, kv_lora)
    out = hax.dot(context, w_uv.astype(context.dtype), axis=KvLora)  # absorbs W_uv
    axes = (*[a for a in q_nope.axes if a.name not in (Heads, QkNope)], Heads, VHead)
    return out.rearrange(axes).astype(q_nope.dtype), cache
