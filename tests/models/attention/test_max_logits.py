"""Per-head maximum logits (QK-clip): vanilla and blockwise report the reference's, leave the
output and its gradient as they were, and other backends are refused by name."""

from __future__ import annotations

import contextlib

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models.attention import max_logits
from loomax.models.attention.attention import causal_attention

B, T, H, KV, D = 2, 24, 4, 2, 8
SCALE = 0.3


def qkv():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = hax.random.normal(ks[0], (hax.Axis("batch", B), hax.Axis("position", T), hax.Axis("heads", H), hax.Axis("head_size", D)))  # fmt: skip
    kv = (hax.Axis("batch", B), hax.Axis("key_position", T), hax.Axis("kv_heads", KV), hax.Axis("head_size", D))  # fmt: skip
    return q, hax.random.normal(ks[1], kv), hax.random.normal(ks[2], kv)


def segments():
    return hax.named(jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [10, 8, 6], axis=1)), ("batch", "position"))  # fmt: skip


def reference(q, k, seg, window):
    """Numpy: each query head's largest scaled score over its visible keys."""
    qa = np.asarray(q.rearrange(("batch", "heads", "position", "head_size")).array)
    ka = np.repeat(np.asarray(k.rearrange(("batch", "kv_heads", "key_position", "head_size")).array), H // KV, axis=1)  # fmt: skip
    s = np.einsum("bhqd,bhkd->bhqk", qa, ka) * SCALE
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = (j <= i) & (i - j < window)
    seen = seen[None] & (np.asarray(seg.array)[:, :, None] == np.asarray(seg.array)[:, None, :])
    return np.where(seen[:, None], s, -np.inf).max(axis=(0, 2, 3))


def run(backend, q, k, v, seg, window, collect=True):
    def f(q, k, v):
        return causal_attention(q, k, v, backend=backend, segment_ids=seg, flash_block=8, window=window, scale=SCALE)  # fmt: skip

    def loss(q, k, v):
        with max_logits.collecting() if collect else contextlib.nullcontext({}) as seen:
            out = f(q, k, v)
        return jnp.sum(jnp.sin(out.array)), dict(seen)

    (value, seen), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)  # fmt: skip
    return value, seen, grads


@pytest.mark.parametrize("backend", ["vanilla", "blockwise"])
def test_reported_maxima_are_the_visible_scores_and_change_nothing_else(backend, monkeypatch):
    from loomax.models.attention import vanilla

    monkeypatch.setattr(vanilla, "QUERY_BLOCK", 8)  # several query blocks either way
    q, k, v = qkv()
    seg, window = segments(), 12
    value, seen, grads = run(backend, q, k, v, seg, window)
    assert seen[max_logits.ATTN].axes == (hax.Axis("heads", H),)
    np.testing.assert_allclose(seen[max_logits.ATTN].array, reference(q, k, seg, window), rtol=1e-5)
    plain_value, nothing, plain_grads = run(backend, q, k, v, seg, window, collect=False)
    assert nothing == {}
    assert value == plain_value
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["xla", "splash"])
def test_other_backends_are_refused_by_name(backend):
    q, k, v = qkv()
    with max_logits.collecting(), pytest.raises(ConfigError, match=f"qk_clip_tau.*{backend}"):
        causal_attention(q, k, v, backend=backend)
