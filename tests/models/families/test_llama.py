"""Llama: shapes with GQA and head_dim override, tied head, QK-norm, rotary variants, remat policies,
document masking through the model, and z-loss."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.models import LlamaConfig, next_token_loss
from loomax.models.attention.attention import segment_ids_from_eos
from loomax.models.attention.rotary import (
    DefaultRotary,
    LinearRotary,
    Llama3Rotary,
    RotaryConfig,
    YarnRotary,
    apply_rotary,
)

VOCAB = 67
TINY = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)


@eqx.filter_jit
def build(config: LlamaConfig, seed: int):
    return config.build(VOCAB, key=jax.random.PRNGKey(seed))


@eqx.filter_jit
def logits_of(model, ids, segment_ids=None):
    """The model's logits as training computes them: in one jit."""
    return model.logits(ids, segment_ids=segment_ids).array


@eqx.filter_jit
def loss_grads(model, batch):
    return jax.grad(lambda m: next_token_loss(m, batch)[0])(model)


def tokens(batch=2, seq=32, seed=0):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 1, VOCAB)
    return hax.named(ids, ("batch", "position"))


@pytest.fixture(scope="module")
def model():
    return build(TINY, 0)


def test_gqa_axes_and_param_count(model):
    attn = model.blocks.stacked.attn
    assert attn.k_proj.weight.resolve_axis("kv_heads").size == 2
    assert attn.q_proj.weight.resolve_axis("heads").size == 4
    d, m, L, V, hs = 32, 64, 2, VOCAB, 8
    per_layer = d * 4 * hs + 2 * d * 2 * hs + 4 * hs * d + 3 * d * m + 2 * d
    assert TINY.param_count(VOCAB) == V * d + L * per_layer + d + V * d  # untied head
    logits = eqx.filter_jit(lambda m: m.logits(tokens()))(model)
    assert logits.axes == (hax.Axis("batch", 2), hax.Axis("position", 32), hax.Axis("vocab", VOCAB))


def test_head_dim_override_tied_and_qk_norm():
    config = LlamaConfig(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=48,
        num_layers=1,
        num_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        qk_norm=True,
    )
    model = build(config, 1)
    assert model.lm_head is None
    assert model.blocks.stacked.attn.q_norm.weight.resolve_axis("head_size").size == 24
    assert model.blocks.stacked.attn.q_proj.weight.resolve_axis("head_size").size == 24
    assert np.isfinite(logits_of(model, tokens(seq=16))).all()


def test_causal(model):
    a = tokens()
    b = hax.named(a.array.at[:, 20:].set((a.array[:, 20:] + 1) % VOCAB), a.axes)
    la, lb = logits_of(model, a), logits_of(model, b)
    np.testing.assert_allclose(la[:, :20], lb[:, :20], rtol=1e-5, atol=1e-5)
    assert not np.allclose(la[:, 20:], lb[:, 20:])


def test_document_mask_isolates_packed_documents(model):
    eos = 0
    a = np.asarray(tokens().array).copy()
    a[:, 11] = eos  # document 0 = positions 0..11
    b = a.copy()
    b[:, :11] = (b[:, :11] + 3) % (VOCAB - 1) + 1  # change document 0 only (never into EOS)
    ta, tb = hax.named(a, ("batch", "position")), hax.named(b, ("batch", "position"))
    la = logits_of(model, ta, segment_ids_from_eos(ta, eos))
    lb = logits_of(model, tb, segment_ids_from_eos(tb, eos))
    np.testing.assert_allclose(la[:, 12:], lb[:, 12:], rtol=1e-5, atol=1e-5)
    unmasked = logits_of(model, tb)
    assert not np.allclose(unmasked[:, 12:], lb[:, 12:], atol=1e-4)


@pytest.fixture(scope="module")
def default_grads(model):
    return loss_grads(model, tokens())


@pytest.mark.parametrize("policy", [False, "offload", "nested"])
def test_remat_policies_do_not_change_gradients(default_grads, policy):
    other = dataclasses.replace(TINY, gradient_checkpointing=policy)
    other = build(other, 0)
    grads = loss_grads(other, tokens())
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(default_grads), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_flops_per_token_counts_causal_attention_as_half():
    """Llama-1B's shape (GQA, head_dim 64): attention 2 x seq x (heads x head_dim) a layer."""
    c = LlamaConfig(
        seq_len=4096, hidden_dim=2048, intermediate_dim=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64,
    )  # fmt: skip
    v, s, d, m, q, kv = 50257, 4096, 2048, 8192, 32 * 64, 8 * 64
    dense = 2 * d * (2 * q + 2 * kv) + 2 * 3 * d * m
    assert c.flops_per_token(v) == 16 * (dense + 2 * s * q) + 2 * d * v
    assert c.flops_per_token(v, causal=False) - c.flops_per_token(v) == 16 * 2 * s * q
    # a sliding window of w: each query sees w keys (full), the causal mean w - w^2 / 2s
    w = 1024
    windowed = dataclasses.replace(c, sliding_window=w)
    seen = w - w * w / (2 * s)
    assert windowed.flops_per_token(v) == 16 * (dense + 4 * seen * q) + 2 * d * v
    full = windowed.flops_per_token(v, causal=False)
    assert full == 16 * (dense + 4 * w * q) + 2 * d * v


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="model.num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3, hidden_dim=32)
    with pytest.raises(ValueError, match="model.gradient_checkpointing"):
        LlamaConfig(gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="model.attn_backend"):
        LlamaConfig(attn_backend="magic")


def test_rotary_variants():
    d = 16
    base = DefaultRotary(theta=10000.0).inv_freq(d)
    np.testing.assert_allclose(LinearRotary(factor=4.0).inv_freq(d), base / 4)
    l3 = Llama3Rotary(factor=8.0, original_max_position_embeddings=64).inv_freq(d)
    assert l3[0] == base[0] and np.isclose(l3[-1], base[-1] / 8)  # short kept, long scaled
    yarn = YarnRotary(factor=4.0, original_max_position_embeddings=64)
    inv = yarn.inv_freq(d)
    assert inv[0] == base[0] and np.isclose(inv[-1], base[-1] / 4) and yarn.attention_factor() > 1
    assert RotaryConfig.from_hf(
        500000.0, l3_hf := Llama3Rotary().hf_rope_scaling()
    ) == Llama3Rotary(theta=500000.0), l3_hf
    # rotation preserves norms and relative positions: <R(p)q, R(p+s)k> depends on s only
    q = hax.named(jax.random.normal(jax.random.PRNGKey(0), (1, d)), ("position", "head_size"))
    k = hax.named(jax.random.normal(jax.random.PRNGKey(1), (1, d)), ("position", "head_size"))
    rope = DefaultRotary()

    def rot(x, p):
        return apply_rotary(x, hax.named(np.array([p]), "position"), rope).array[0]

    np.testing.assert_allclose(np.linalg.norm(rot(q, 5)), np.linalg.norm(q.array[0]), rtol=1e-5)
    np.testing.assert_allclose(rot(q, 3) @ rot(k, 7), rot(q, 10) @ rot(k, 14), rtol=1e-4)


def test_z_loss_adds_squared_log_partition(model):
    batch = tokens()
    loss = eqx.filter_jit(next_token_loss)
    plain, n = loss(model, batch, block_size=None)
    for block, vocab_block in ((None, None), (16, None), (16, 10)):
        with_z, _ = loss(
            model, batch, block_size=block, z_loss_weight=1e-2, vocab_block_size=vocab_block
        )
        logits = logits_of(model, batch)[:, :-1]
        lse = jax.nn.logsumexp(logits, axis=-1)
        np.testing.assert_allclose(with_z, plain + 1e-2 * np.sum(lse**2), rtol=1e-5)
