"""A window-sized KV cache for sliding-window decoding: position ``p`` lives in slot ``p % W``.

When every layer attends over the same window of ``w`` positions (Mistral), keys older than
``w`` positions are never seen again. Generation (``models.generate``) then prefills the
prompt into a cache of the prompt's bucket, keeps its last ``w`` positions (``to_rolling``),
and decodes each new token into the slot of the key ``w`` positions older
(``rolling_attention``): the cache and each step's attention are the window's size, not the
generation buffer's. While no more than ``W`` positions are written it computes exactly
what a full cache does, so a decoder takes this form for any cache no longer than its window.
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.models.attention.attention import _from_array, _to_arrays
from loomax.models.attention.flash import visible_mask
from loomax.models.attention.sinks import sink_array, sink_softmax
from loomax.models.axes import KeyPosition, Position
from loomax.models.config import KvCache

EMPTY = jnp.iinfo(jnp.int32).max
"""The position of a slot nothing was written to: after every query, so never visible."""


def uses_rolling(cache_k: NamedArray, window) -> bool:
    """Whether decoding with this cache takes the rolling form: a static window at least
    the cache's length."""
    return isinstance(window, int) and cache_k.resolve_axis(KeyPosition).size <= window


def slot_positions(start: jax.Array, slots: int) -> jax.Array:
    """The position each of ``slots`` slots holds once positions ``0 .. start - 1`` are
    written (``EMPTY`` where none was)."""
    last = start - 1
    held = last - jnp.mod(last - jnp.arange(slots), slots)
    return jnp.where(held >= 0, held, EMPTY)


def to_rolling(cache: KvCache, length: jax.Array, window: int) -> KvCache:
    """A rolling cache of ``window`` slots holding the last ``window`` of the first ``length``
    positions of a position-ordered ``cache`` (shorter caches are padded; empty slots are
    never visible)."""

    def roll(x: NamedArray) -> NamedArray:
        axis = x.axes.index(x.resolve_axis(KeyPosition))
        held = slot_positions(length, window)
        rows = jnp.take(x.array, jnp.clip(held, 0, x.array.shape[axis] - 1), axis=axis)
        axes = tuple(a.resize(window) if a.name == KeyPosition else a for a in x.axes)
        return hax.named(rows, axes)

    return KvCache(roll(cache.k), roll(cache.v))


def rolling_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    cache_k: NamedArray,
    cache_v: NamedArray,
    start: jax.Array,
    window: int,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: NamedArray | None = None,
) -> tuple[NamedArray, NamedArray, NamedArray]:
    """``cached_attention`` on a rolling cache: ``(out, cache_k, cache_v)``. ``q``, ``k``,
    ``v`` hold positions ``start, start + 1, ...``; each query sees the cached and new keys
    at or before it and fewer than ``window`` back; the last ``min(T, W)`` new keys are
    written to their slots."""
    k = k.rename({Position: KeyPosition})
    v = v.rename({Position: KeyPosition})
    W = cache_k.resolve_axis(KeyPosition).size
    T = k.resolve_axis(KeyPosition).size
    qa, old_k, old_v, batch_axes = _to_arrays(q, cache_k, cache_v)
    _, new_k, new_v, _ = _to_arrays(q, k, v)
    ka = jnp.concatenate([old_k, new_k], axis=2)
    va = jnp.concatenate([old_v, new_v], axis=2)
    q_pos = start + jnp.arange(T)
    k_pos = jnp.concatenate([slot_positions(start, W), q_pos])
    scale = 1 / math.sqrt(qa.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bkgqd,bksd->bkgqs", qa * jnp.asarray(scale, qa.dtype), ka,
                        preferred_element_type=jnp.float32)  # fmt: skip
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    visible = visible_mask(q_pos, k_pos, None, None, window)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    weights = sink_softmax(scores, sink_array(sinks, ka.shape[1])).astype(va.dtype)
    out = jnp.einsum("bkgqs,bksd->bkgqd", weights, va)
    kept = min(T, W)
    slots = jnp.mod(start + jnp.arange(T - kept, T), W)
    cache_k, cache_v = (_write(c, x, slots, T - kept) for c, x in ((cache_k, k), (cache_v, v)))
    return _from_array(out, q, batch_axes), cache_k, cache_v


def _write(cache: NamedArray, new: NamedArray, slots: jax.Array, first: int) -> NamedArray:
    """``cache`` with ``new``'s positions from ``first`` on written at ``slots``."""
    axis = cache.axes.index(cache.resolve_axis(KeyPosition))
    names = tuple(a.name for a in cache.axes)
    rows = jnp.moveaxis(new.rearrange(names).array, axis, 0)[first:]
    written = jnp.moveaxis(cache.array, axis, 0).at[slots].set(rows.astype(cache.dtype))
    return hax.named(jnp.moveaxis(written, 0, axis), cache.axes)
