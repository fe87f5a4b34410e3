"""QK-clip: per head, the largest logit over the threshold comes back to it; others untouched."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.models import LlamaConfig
from loomax.optim.qk_clip import qk_clip

CONFIG = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=16, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=4)  # fmt: skip


def logits(attn, x):
    """Per query head, q . k over every (query, key) position pair, unscaled (no rotary)."""
    q = attn.q_proj(x).rearrange(("layers", "position", "heads", "head_size")).array[0]
    k = attn.k_proj(x).rearrange(("layers", "position", "kv_heads", "head_size")).array[0]
    k = np.repeat(np.asarray(k), 2, axis=1)  # query head h reads key head h // 2
    return np.einsum("phd,shd->hps", np.asarray(q), k)


def test_heads_over_the_threshold_come_back_to_it_exactly():
    model = CONFIG.build(32, key=jax.random.PRNGKey(0))
    named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    attn = jax.tree.map(lambda x: x * 3.0, model.blocks.stacked.attn, is_leaf=named)  # 1 layer
    x = hax.random.normal(jax.random.PRNGKey(1), (hax.Axis("position", 8), hax.Axis("embed", 16)))
    before = np.abs(logits(attn, x)).max(axis=(1, 2))
    threshold = float(np.sort(before)[1])  # two heads over it, two under
    clipped = qk_clip(attn, hax.named(before[None], ("layers", "heads")), threshold)
    after = np.abs(logits(clipped, x)).max(axis=(1, 2))
    np.testing.assert_allclose(after, np.minimum(before, threshold), rtol=1e-4)
    v = clipped.v_proj.weight.array
    np.testing.assert_array_equal(v, attn.v_proj.weight.array)


def test_qk_norm_is_refused():
    model = LlamaConfig(**{**CONFIG.__dict__, "qk_norm": True}).build(32, key=jax.random.PRNGKey(0))
    attn = model.blocks.stacked.attn
    with pytest.raises(ValueError, match="QK-norm"):
        qk_clip(attn, hax.named(np.ones(4), "heads"), 1.0)
