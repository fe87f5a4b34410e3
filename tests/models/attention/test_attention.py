"""Every attention backend agrees with the others (fp32, 1e-5), with and without packed-document
masks and sliding windows; the blocked backends skip the key blocks outside a window."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.attention import attention, vanilla
from loomax.models.attention.attention import causal_attention, segment_ids_from_eos

B, T, H, KV, D = 2, 40, 4, 2, 8
EOS = 7


def qkv(kv_heads=KV, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = hax.named(jax.random.normal(kq, (B, T, H, D)), ("batch", "position", "heads", "head_size"))
    kv_name = "kv_heads" if kv_heads != H else "heads"
    axes = ("batch", "key_position", kv_name, "head_size")
    k = hax.named(jax.random.normal(kk, (B, T, kv_heads, D)), axes)
    v = hax.named(jax.random.normal(kv, (B, T, kv_heads, D)), axes)
    return q, k, v


def packed_segments():
    tokens = np.full((B, T), 3, np.int32)
    tokens[0, [5, 17, 30]] = EOS
    tokens[1, [0, 21]] = EOS
    return segment_ids_from_eos(hax.named(jnp.asarray(tokens), ("batch", "position")), EOS)


def reference(q, k, v, segments, window=None):
    """Plain softmax attention over the full masked square, written out in numpy."""
    qa = np.asarray(q.rearrange(("batch", "heads", "position", "head_size")).array, np.float64)
    kv_name = "kv_heads" if k.has_axis("kv_heads") else "heads"
    ka = np.asarray(k.rearrange(("batch", kv_name, "key_position", "head_size")).array, np.float64)
    va = np.asarray(v.rearrange(("batch", kv_name, "key_position", "head_size")).array, np.float64)
    group = H // ka.shape[1]
    ka, va = np.repeat(ka, group, axis=1), np.repeat(va, group, axis=1)
    scores = qa @ ka.transpose(0, 1, 3, 2) / np.sqrt(D)
    mask = np.tril(np.ones((T, T), bool))[None, None]
    if window is not None:  # at most window - 1 keys back
        mask = mask & np.triu(np.ones((T, T), bool), -(window - 1))
    if segments is not None:
        seg = np.asarray(segments.array)
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ va  # [batch, heads, position, head_size]


def attend(q, k, v, **kwargs):
    """causal_attention as models call it: inside one jit (traced anew per call, so the
    block sizes a test patches in are the ones it runs)."""
    return eqx.filter_jit(causal_attention)(q, k, v, **kwargs)


def test_segment_ids_from_eos():
    seg = np.asarray(packed_segments().array)
    assert seg[0, :6].tolist() == [0] * 6  # the EOS at 5 closes document 0
    assert seg[0, 6] == 1 and seg[0, 17] == 1 and seg[0, 18] == 2 and seg[0, -1] == 3
    assert seg[1, 0] == 0 and seg[1, 1] == 1


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks smaller than the sequence (and not dividing it) so every block path runs."""
    monkeypatch.setattr(vanilla, "QUERY_BLOCK", 16)
    monkeypatch.setattr(attention, "FLASH_BLOCK", 16)


BACKENDS = ["vanilla", "blockwise", "xla", "cudnn"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("kv_heads", [H, KV], ids=["mha", "gqa"])
def test_backends_agree(small_blocks, backend, masked, kv_heads):
    if backend == "cudnn" and jax.default_backend() != "gpu":
        pytest.skip("cudnn attention needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
    q, k, v = qkv(kv_heads)
    segments = packed_segments() if masked else None
    if backend == "cudnn":  # cuDNN flash attention takes half precision only
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = attend(q, k, v, backend=backend, segment_ids=segments)
    assert out.axes == q.axes
    got = np.asarray(out.rearrange(("batch", "heads", "position", "head_size")).array, np.float64)
    tol = 2e-2 if backend == "cudnn" else 1e-5
    np.testing.assert_allclose(got, reference(q, k, v, segments), rtol=tol, atol=tol)


WINDOW_BACKENDS = ["vanilla", "blockwise", "xla", "splash"]


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_backends_agree_within_a_sliding_window(small_blocks, backend, masked):
    q, k, v = qkv()
    segments = packed_segments() if masked else None
    want = reference(q, k, v, segments, window=5)
    splash = {}
    if backend == "splash":  # the kernel's blocks are multiples of 128: pad the sequence
        q, k, v, segments = _padded(q, k, v, segments, 128)
        splash = dict(splash_blocks=(128, 128))
    out = attend(q, k, v, backend=backend, segment_ids=segments, window=5, **splash)
    got = np.asarray(out.rearrange(("batch", "heads", "position", "head_size")).array, np.float64)
    np.testing.assert_allclose(got[:, :, :T], want, rtol=1e-5, atol=1e-5)


def _padded(q, k, v, segments, length):
    """``q, k, v, segments`` padded at the end to ``length`` positions (causal: the real
    queries never see the padding)."""

    def grow(x, axis):
        widths = [(0, length - T if a.name == axis else 0) for a in x.axes]
        return hax.named(jnp.pad(x.array, widths), tuple(a.name for a in x.axes))

    seg = None if segments is None else grow(segments, "position")
    return grow(q, "position"), grow(k, "key_position"), grow(v, "key_position"), seg


@pytest.mark.parametrize("backend", ["vanilla", "blockwise"])
def test_blocks_outside_the_window_are_skipped_not_masked(monkeypatch, backend):
    """Values of NaN at position 0: a masked-but-computed block would carry them (0 * NaN) to
    every query of its blocks; skipped, the queries whose blocks are past the window stay finite."""
    monkeypatch.setattr(vanilla, "QUERY_BLOCK", 8)
    q, k, v = qkv()
    v = hax.named(v.array.at[:, 0].set(jnp.nan), v.axes)
    out = np.asarray(attend(q, k, v, backend=backend, window=4, flash_block=8).array)
    assert np.isnan(out[:, :4]).all()  # they see key 0
    assert np.isfinite(out[:, 16:]).all()  # their blocks (from 16) start past 0 + window
    full = np.asarray(attend(q, k, v, backend=backend, flash_block=8).array)
    assert np.isnan(full[:, 16:]).all()  # without a window they see key 0


def test_cached_attention_keeps_the_window():
    q, k, v = qkv()
    cache = hax.zeros(k.axes, k.dtype)
    window, want = 5, attend(q, k, v, backend="vanilla", window=5)
    out, _, _ = attention.cached_attention(
        q[{"position": slice(T - 3, T)}],
        k[{"key_position": slice(T - 3, T)}].rename({"key_position": "position"}),
        v[{"key_position": slice(T - 3, T)}].rename({"key_position": "position"}),
        hax.named(cache.array.at[:, : T - 3].set(k.array[:, : T - 3]), k.axes),
        hax.named(cache.array.at[:, : T - 3].set(v.array[:, : T - 3]), v.axes),
        jnp.asarray(T - 3),
        window,
    )
    np.testing.assert_allclose(out.array, want.array[:, T - 3 :], rtol=1e-5, atol=1e-5)


def test_documents_do_not_see_each_other():
    q, k, v = qkv()
    segments = packed_segments()
    base = attend(q, k, v, backend="blockwise", segment_ids=segments)
    k2 = hax.named(k.array.at[0, :6].multiply(3.0), k.axes)  # change document 0 of row 0 only
    moved = attend(q, k2, v, backend="blockwise", segment_ids=segments)
    np.testing.assert_allclose(base.array[0, 6:], moved.array[0, 6:], atol=1e-6)
    assert not np.allclose(base.array[0, :6], moved.array[0, :6])


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_blockwise_gradient_matches_vanilla(small_blocks, masked, window):
    q, k, v = qkv()
    segments = packed_segments() if masked else None
    cot = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, D))

    def loss(backend):
        def f(qa, ka, va):
            out = causal_attention(
                hax.named(qa, q.axes),
                hax.named(ka, k.axes),
                hax.named(va, v.axes),
                backend=backend,
                segment_ids=segments,
                window=window,
            )
            return jnp.sum(out.rearrange(q.axes).array * cot)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q.array, k.array, v.array)

    for got, want in zip(loss("blockwise"), loss("vanilla"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_models_give_the_same_logits_with_every_cpu_backend(family):
    from loomax.models import Gpt2Config, LlamaConfig

    def build(backend):
        if family == "gpt2":
            config = Gpt2Config(
                seq_len=32, hidden_dim=32, num_layers=1, num_heads=4, attn_backend=backend
            )
        else:
            config = LlamaConfig(
                seq_len=32,
                hidden_dim=32,
                intermediate_dim=64,
                num_layers=1,
                num_heads=4,
                num_kv_heads=2,
                attn_backend=backend,
            )
        return config.build(50, key=jax.random.PRNGKey(0))

    ids = hax.named(
        jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 50), ("batch", "position")
    )
    segments = segment_ids_from_eos(ids, 7)
    logits = eqx.filter_jit(lambda model: model.logits(ids, segment_ids=segments).array)
    want = logits(build("vanilla"))
    for backend in ("blockwise", "xla"):
        got = logits(build(backend))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend)


def test_auto_backend_choice():
    from loomax.models.attention.attention import gpu_compute_capability, resolve_backend

    on_gpu = gpu_compute_capability() is not None
    assert resolve_backend("auto", jnp.float32, 256) == "vanilla"
    assert resolve_backend("auto", jnp.float32, 8192) == "blockwise"
    assert resolve_backend("auto", jnp.bfloat16, 256) == ("cudnn" if on_gpu else "vanilla")
    assert resolve_backend("xla", jnp.float32, 8192) == "xla"


HOPPER, AMPERE, VOLTA = (9, 0), (8, 0), (7, 0)


@pytest.mark.parametrize(
    ("dtype", "head", "seq", "segments", "capability", "want"),
    [
        (jnp.bfloat16, 64, 1024, False, HOPPER, "cudnn"),
        (jnp.float16, 128, 4096, True, AMPERE, "cudnn"),
        (jnp.bfloat16, 256, 1024, False, HOPPER, "cudnn"),  # Hopper takes heads up to 256
        (jnp.bfloat16, 256, 1024, False, AMPERE, "vanilla"),  # ... earlier GPUs up to 128
        (jnp.bfloat16, 256, 4096, False, AMPERE, "blockwise"),
        (jnp.bfloat16, 12, 1024, False, HOPPER, "vanilla"),  # not a multiple of 8
        (jnp.bfloat16, 320, 1024, False, HOPPER, "vanilla"),
        (jnp.float32, 64, 1024, False, HOPPER, "vanilla"),  # cuDNN takes half precision only
        (jnp.bfloat16, 64, 1023, True, HOPPER, "vanilla"),  # a mask (bias) needs an even length
        (jnp.bfloat16, 64, 1023, False, HOPPER, "cudnn"),
        (jnp.bfloat16, 64, 1024, False, VOLTA, "vanilla"),
        (jnp.bfloat16, 64, 1024, False, None, "vanilla"),  # no NVIDIA GPU
    ],
)
def test_auto_uses_cudnn_only_where_it_can_serve(dtype, head, seq, segments, capability, want):
    from loomax.models.attention.attention import cudnn_unsupported_reason, resolve_backend

    got = resolve_backend(
        "auto", dtype, seq, head, segments=segments, compute_capability=capability
    )
    assert got == want
    reason = cudnn_unsupported_reason(
        dtype, head, seq, segments=segments, compute_capability=capability
    )
    assert (reason is None) == (want == "cudnn")


def test_cudnn_asked_for_where_it_cannot_serve_says_why():
    from loomax.models.attention.attention import resolve_backend

    with pytest.raises(ValueError, match=r"model.attn_backend cudnn .*head size 12"):
        resolve_backend("cudnn", jnp.bfloat16, 256, 12, compute_capability=HOPPER)
    with pytest.raises(ValueError, match="no NVIDIA GPU"):
        resolve_backend("cudnn", jnp.bfloat16, 256, 64, compute_capability=None)
    assert resolve_backend("cudnn", jnp.bfloat16, 256, 64, compute_capability=HOPPER) == "cudnn"
