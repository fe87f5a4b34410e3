"""QK-clip (MuonClip's second half, Kimi K2): shrink an attention's query and key projections,
per head, so that a head whose largest attention logit passed ``threshold`` is brought back to it.

With ``optimizer.qk_clip_tau`` set, the train step collects each attention's per-head maximum
logit of the step's batch (``models/attention/max_logits.py``: the largest over microbatches)
and, after the optimizer update, ``clip_model`` rescales the model's query and key
projections; a model names its attentions by the stacks' keys (``qk_clip_attention``).

For query head ``h`` with maximum logit ``S_h``, ``g_h = min(1, threshold / S_h)``. Logits are
``q_h . k_j`` with ``j`` the key head ``h`` shares (grouped-query attention: query head ``h``
reads key head ``h // (heads / kv_heads)``, as Hugging Face's ``repeat_kv``). Key head ``j`` is
scaled by ``sqrt(m_j)``, ``m_j`` the smallest ``g`` of its query heads, and query head ``h`` by
``g_h / sqrt(m_j)``: every logit of head ``h`` scales by exactly ``g_h`` (multi-head attention:
``sqrt(g_h)`` on both, as Kimi K2). Heads under the threshold are untouched; biases scale
with their weights. A model with QK-norm normalises the projections away: refused.

Multi-head latent attention (``mla_qk_clip``), as Kimi K2: each head's non-rotary query and key
(``q_b_proj``/``q_proj`` and ``kv_b_proj``'s key rows) by ``sqrt(g_h)``, its rotary query by
``g_h``; the rotary key, shared by every head, and the values are not touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

HEADS, KV_HEADS, HEAD_SIZE = "heads", "kv_heads", "head_size"


def _scaled(linear: hnn.Linear, factor: hax.NamedArray) -> hnn.Linear:
    def scale(x):
        return None if x is None else (x * factor).astype(x.dtype).rearrange(x.axes)

    return eqx.tree_at(
        lambda m: (m.weight, m.bias),
        linear,
        (scale(linear.weight), scale(linear.bias)),
        is_leaf=lambda x: x is None,
    )


def qk_clip(attn, max_logits: hax.NamedArray, threshold: float):
    """``attn`` (a module with ``q_proj`` embed -> (heads, head_size) and ``k_proj``
    embed -> (kv_heads, head_size) Linears, stacked or not) with its projections rescaled
    so that no head's logits pass ``threshold``; ``max_logits`` has the ``heads`` axis (and
    ``layers`` for a stacked attention)."""
    if getattr(attn, "q_norm", None) is not None:
        raise ValueError("qk_clip: this attention normalises q and k (QK-norm); nothing to clip")
    if threshold <= 0:
        raise ValueError(f"qk_clip: threshold must be > 0, got {threshold}")
    gamma = _gamma(max_logits, threshold)
    H = gamma.resolve_axis(HEADS)
    kv = attn.k_proj.weight.resolve_axis(KV_HEADS)
    group = hax.Axis("q_per_kv", H.size // kv.size)
    grouped = gamma.unflatten_axis(HEADS, (kv, group))
    smallest = hax.min(grouped, axis=group)  # per key head
    k_factor = _root(smallest)
    q_factor = (grouped / k_factor).flatten_axes((kv, group), HEADS)
    q_factor = q_factor.rename({HEADS: H.name})
    q_factor = hax.NamedArray(q_factor.array.astype(jnp.float32), q_factor.axes)
    return eqx.tree_at(
        lambda a: (a.q_proj, a.k_proj),
        attn,
        (_scaled(attn.q_proj, q_factor), _scaled(attn.k_proj, k_factor)),
    )


def _gamma(max_logits: hax.NamedArray, threshold: float) -> hax.NamedArray:
    return hax.minimum(1.0, threshold / hax.maximum(max_logits.astype(jnp.float32), 1e-30))


def _root(gamma: hax.NamedArray) -> hax.NamedArray:
    """``sqrt(gamma)``, exactly 1 where ``gamma`` is (a fast square root may miss it by an
    ulp, which would move the weights of heads under the threshold)."""
    return hax.where(gamma < 1.0, hax.sqrt(gamma), 1.0)


def _two_part(axis: hax.Axis, first: int, head: Any, rest: Any) -> hax.NamedArray:
    """A factor along ``axis``: ``head`` on its first ``first`` entries, ``rest`` after."""
    mask = (hax.arange(axis) < first).astype(jnp.float32)
    head, rest = (
        hax.broadcast_axis(x, axis) if isinstance(x, hax.NamedArray) else x for x in (head, rest)
    )
    return head * mask + rest * (1.0 - mask)


def mla_qk_clip(attn, max_logits: hax.NamedArray, threshold: float):
    """A multi-head latent attention (``MlaAttention``, stacked or not) with each head over
    ``threshold`` rescaled as Kimi K2 does (the module docstring); ``max_logits`` as in
    ``qk_clip``."""
    if threshold <= 0:
        raise ValueError(f"qk_clip: threshold must be > 0, got {threshold}")
    c = attn.config
    gamma = _gamma(max_logits, threshold)
    root = _root(gamma)
    q_lin = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
    q_factor = _two_part(q_lin.weight.resolve_axis(HEAD_SIZE), c.qk_nope_head_dim, root, gamma)
    kv_factor = _two_part(attn.kv_b_proj.weight.resolve_axis("kv_b"), c.qk_nope_head_dim, root, 1.0)
    name = "q_proj" if attn.q_proj is not None else "q_b_proj"
    return eqx.tree_at(
        lambda a: (getattr(a, name), a.kv_b_proj),
        attn,
        (_scaled(q_lin, q_factor), _scaled(attn.kv_b_proj, kv_factor)),
    )


def clip_attention(attn, max_logits: hax.NamedArray, threshold: float):
    """``mla_qk_clip`` for a multi-head latent attention, else ``qk_clip``."""
    clip = mla_qk_clip if hasattr(attn, "kv_b_proj") else qk_clip
    return clip(attn, max_logits, threshold)


def clip_model(
    model, maxima: Mapping[str, hax.NamedArray], threshold: float
) -> tuple[Any, dict[str, jax.Array]]:
    """``(model with every attention named in maxima clipped, metrics)``: ``maxima`` maps the
    names of ``model.qk_clip_attention()`` to their per-head maximum logits; the metrics are
    ``optim/max_logit`` (the largest of them) and ``optim/qk_clipped_heads`` (how many heads,
    over layers, passed ``threshold``)."""
    where: Mapping[str, Callable[[Any], Any]] = getattr(model, "qk_clip_attention", dict)()
    unknown = sorted(set(maxima) - set(where))
    if unknown or not maxima:
        raise ValueError(
            f"optimizer.qk_clip_tau: {type(model).__name__} does not map the attention maxima "
            f"{unknown or 'it reported (none)'} to its attention modules (qk_clip_attention)"
        )
    for name, peaks in maxima.items():
        model = eqx.tree_at(
            where[name], model, clip_attention(where[name](model), peaks, threshold)
        )
    top = jnp.max(jnp.stack([jnp.max(p.array) for p in maxima.values()]))
    over = sum(jnp.sum(p.array > threshold) for p in maxima.values())
    return model, {"optim/max_logit": top, "optim/qk_clipped_heads": over.astype(jnp.float32)}
