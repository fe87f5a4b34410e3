"""QK-clip (MuonClip's second half, Kimi K2): shrink an attention's query and key projections,
per head, so that a head whose largest attention logit passed ``threshold`` is brought back to it.

Not wired into the step yet: the step must get each attention's per-head maximum logit
from the model (the attention backends do not return it today). This module is the
parameter side, a pure function of an attention module and those maxima.

For query head ``h`` with maximum logit ``S_h``, ``g_h = min(1, threshold / S_h)``. Logits are
``q_h . k_j`` with ``j`` the key head ``h`` shares (grouped-query attention: query head ``h``
reads key head ``h // (heads / kv_heads)``, as Hugging Face's ``repeat_kv``). Key head ``j`` is
scaled by ``sqrt(m_j)``, ``m_j`` the smallest ``g`` of its query heads, and query head ``h`` by
``g_h / sqrt(m_j)``: every logit of head ``h`` scales by exactly ``g_h`` (multi-head attention:
``sqrt(g_h)`` on both, as Kimi K2). Heads under the threshold are untouched; biases scale
with their weights. A model with QK-norm normalises the projections away: refused.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp

HEADS, KV_HEADS = "heads", "kv_heads"


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
    gamma = hax.minimum(1.0, threshold / hax.maximum(max_logits, 1e-30))
    H = gamma.resolve_axis(HEADS)
    kv = attn.k_proj.weight.resolve_axis(KV_HEADS)
    group = hax.Axis("q_per_kv", H.size // kv.size)
    grouped = gamma.unflatten_axis(HEADS, (kv, group))
    smallest = hax.min(grouped, axis=group)  # per key head
    q_factor = (grouped / hax.sqrt(smallest)).flatten_axes((kv, group), HEADS)
    q_factor = q_factor.rename({HEADS: H.name})
    k_factor = hax.sqrt(smallest)
    q_factor = hax.NamedArray(q_factor.array.astype(jnp.float32), q_factor.axes)
    return eqx.tree_at(
        lambda a: (a.q_proj, a.k_proj),
        attn,
        (_scaled(attn.q_proj, q_factor), _scaled(attn.k_proj, k_factor)),
    )
