"""Attention sinks (``models/attention/sinks.py``) in every backend that has them, against a
float64 numpy softmax with the sink's column (vanilla) and against vanilla (the others),
values and gradients (the sinks' own included); decoding over a KV cache (full and
rolling) against the whole sequence; the backends without sinks refused by name."""

from __future__ import annotations

from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models.attention.attention import cached_attention, causal_attention
from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position
from loomax.models.decoding.rolling_cache import rolling_attention

T, H, K, D = 128, 4, 2, 8
SINKS = np.asarray([0.5, -1.0, 2.0, 0.0])
AXES = {
    "q": (Batch, Position, Heads, HeadSize),
    "k": (Batch, Position, KvHeads, HeadSize),
    "v": (Batch, Position, KvHeads, HeadSize),
}


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"q": (2, T, H, D), "k": (2, T, K, D), "v": (2, T, K, D)}
    return {n: rng.normal(size=s) for n, s in shapes.items()}


def named(a):
    return {n: hax.named(jnp.asarray(x, jnp.float32), AXES[n]) for n, x in a.items()}


SEG = np.stack([np.arange(T) // 50, np.zeros(T, int)])


def reference(a, window=None):
    """float64: softmax over [scores, sink] per head, the sink's column dropped."""
    out = np.zeros_like(a["q"])
    for b in range(2):
        for h in range(H):
            q, k, v = a["q"][b, :, h], a["k"][b, :, h // (H // K)], a["v"][b, :, h // (H // K)]
            s = q @ k.T / np.sqrt(D)
            i, j = np.arange(T)[:, None], np.arange(T)[None, :]
            seen = (j <= i) & (SEG[b][:, None] == SEG[b][None, :])
            if window:
                seen &= i - j < window
            s = np.where(seen, s, -np.inf)
            m = np.maximum(s.max(-1, keepdims=True), SINKS[h])
            e = np.exp(s - m)
            out[b, :, h] = e @ v / (e.sum(-1, keepdims=True) + np.exp(SINKS[h] - m))
    return out


def loss_and_grads(backend, window=None, **options):
    seg = hax.named(jnp.asarray(SEG, jnp.int32), (Batch, Position))
    rng = np.random.default_rng(9)
    w = hax.named(jnp.asarray(rng.normal(size=(2, T, H, D)), jnp.float32), AXES["q"])

    def loss(q, k, v, sinks):
        k, v = k.rename({Position: KeyPosition}), v.rename({Position: KeyPosition})
        out = causal_attention(
            q, k, v, backend=backend, segment_ids=seg, window=window, sinks=sinks, **options
        )
        return hax.sum(out * w).scalar(), out

    a = named(arrays())
    sinks = hax.named(jnp.asarray(SINKS, jnp.float32), (Heads,))
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = fn(a["q"], a["k"], a["v"], sinks)
    return out.array, [g.array for g in grads]


@pytest.fixture(scope="module")
def vanilla():
    return {w: loss_and_grads("vanilla", w) for w in (None, 20)}


@pytest.mark.parametrize("window", [None, 20])
def test_vanilla_sinks_are_the_softmax_with_a_sink_column(vanilla, window):
    out, grads = vanilla[window]
    np.testing.assert_allclose(out, reference(arrays(), window), atol=2e-6)
    a = named(arrays())
    k, v = (a[n].rename({Position: KeyPosition}) for n in "kv")
    seg = hax.named(jnp.asarray(SEG, jnp.int32), (Batch, Position))
    plain = causal_attention(a["q"], k, v, backend="vanilla", segment_ids=seg, window=window)
    assert np.abs(out - plain.array).max() > 0.1 and np.abs(grads[3]).max() > 0.1


@pytest.mark.parametrize(
    ("backend", "window", "options"),
    [
        ("blockwise", None, {"flash_block": 32}),
        ("blockwise", 20, {"flash_block": 32}),
        ("splash", None, {"splash_blocks": (128, 128)}),
        ("splash", 20, {"splash_blocks": (128, 128)}),
    ],
)
def test_blockwise_and_splash_sinks_match_vanilla_values_and_gradients(
    vanilla, backend, window, options
):
    out, grads = loss_and_grads(backend, window, **options)
    ref_out, ref_grads = vanilla[window]
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rolling", [False, True])
def test_decoding_with_sinks_matches_the_whole_sequence(rolling):
    """A prefill of 16 positions, then one at a time: each step's output is the whole
    sequence's at that position (rolling: a window of 6, the cache its size)."""
    a = {n: x[:1] for n, x in arrays(3).items()}
    window = 6 if rolling else None
    q, k, v = (hax.named(jnp.asarray(a[n], jnp.float32), AXES[n]) for n in "qkv")
    sinks = hax.named(jnp.asarray(SINKS, jnp.float32), (Heads,))
    kr, vr = k.rename({Position: KeyPosition}), v.rename({Position: KeyPosition})
    whole = causal_attention(q, kr, vr, backend="vanilla", window=window, sinks=sinks)
    slots = hax.Axis(KeyPosition, window or 32)
    axes = (hax.Axis(Batch, 1), slots, hax.Axis(KvHeads, K), hax.Axis(HeadSize, D))
    ck = cv = hax.zeros(axes)
    attend = jax.jit(rolling_attention if rolling else cached_attention, static_argnums=6)
    outs = []
    for start, stop in [(0, 16), *[(p, p + 1) for p in range(16, 24)]]:
        q_, k_, v_ = (x[Position, start:stop] for x in (q, k, v))
        out, ck, cv = attend(q_, k_, v_, ck, cv, jnp.asarray(start), window, None, None, sinks)
        outs.append(out.array)
    got = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(got, whole.array[:, :24], atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "cudnn"])
def test_backends_without_sinks_refuse_them_by_name(backend):
    a = named(arrays())
    k, v = (a[n].rename({Position: KeyPosition}) for n in "kv")
    sinks = hax.named(jnp.zeros(H), (Heads,))
    with pytest.raises(ConfigError, match="attention sinks .* model.attn_backend"):
        causal_attention(a["q"], k, v, backend=backend, sinks=sinks)


@pytest.mark.slow
def test_ring_and_all_gather_sinks_match_one_device(json_worker):
    """Data 2 x context 4 (8 fake CPU devices): values and gradients, the sinks' included
    (their gradient summed over the devices' queries)."""
    result = json_worker(Path(__file__).with_name("sinks_run.py"), devices=8)
    for variant in ("ring", "all_gather"):
        errors = result[variant]
        assert errors["dsinks_size"] > 0.1
        for name in ("out", "dq", "dk", "dv", "dsinks"):
            assert errors[name] < 1e-5, (variant, name, errors)
