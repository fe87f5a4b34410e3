"""GPT-2: axis names and shapes, parameter count, FLOPs, causality, and a finite-difference gradient check."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig
from loomax.models import Gpt2Config, next_token_loss

REPO = Path(__file__).resolve().parents[3]

TINY = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
VOCAB = 61


@eqx.filter_jit
def build(config: Gpt2Config):
    """The model as training initializes it: in one jit."""
    return config.build(VOCAB, key=jax.random.PRNGKey(0))


@eqx.filter_jit
def logits_of(model, ids):
    return model.logits(ids)


@eqx.filter_jit
def loss_grads(model, batch):
    return jax.grad(lambda m: next_token_loss(m, batch)[0])(model)


def tokens(batch=2, seq=16, seed=0):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 0, VOCAB)
    return hax.named(ids, ("batch", "position"))


@pytest.fixture(scope="module")
def model():
    return build(TINY)


def test_named_axes_and_shapes(model):
    assert model.Vocab == hax.Axis("vocab", VOCAB)
    assert model.token_embeddings.weight.axes == (hax.Axis("vocab", VOCAB), hax.Axis("embed", 32))
    qkv = model.blocks.stacked.attn.qkv.weight
    assert {a.name for a in qkv.axes} == {"layers", "embed", "qkv", "heads", "head_size"}
    assert model.blocks.stacked.mlp.up.weight.resolve_axis("mlp").size == 128
    h = eqx.filter_jit(lambda m: m.hidden_states(tokens()))(model)
    assert h.axes == (hax.Axis("batch", 2), hax.Axis("position", 16), hax.Axis("embed", 32))
    logits = logits_of(model, tokens())
    assert logits.axes == (hax.Axis("batch", 2), hax.Axis("position", 16), hax.Axis("vocab", VOCAB))


def test_param_count_matches_leaves(model):
    counted = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    d, L, V, S, M = 32, 2, VOCAB, 16, 128
    per_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * M + M) + (M * d + d) + 4 * d
    assert counted == V * d + S * d + L * per_layer + 2 * d
    assert TINY.param_count(VOCAB) == counted


def test_untied_head_adds_vocab_by_embed():
    untied = Gpt2Config(
        seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, tie_word_embeddings=False
    )
    assert untied.param_count(VOCAB) - TINY.param_count(VOCAB) == VOCAB * 32
    model = build(untied)
    assert model.lm_head_weight().axes == (hax.Axis("vocab", VOCAB), hax.Axis("embed", 32))


def test_flops_per_token_by_hand():
    """Causal attention counts half the score matrix (2 x seq x d a layer for QK^T and PV)."""
    config = Gpt2Config(seq_len=256, hidden_dim=256, num_layers=4, num_heads=4)
    d, s, v = 256, 256, 50257
    expected = 4 * (6 * d * d + 2 * d * d + 16 * d * d + 2 * s * d) + 2 * d * v
    assert config.flops_per_token(v) == expected
    assert config.flops_per_token(v, causal=False) == expected + 4 * 2 * s * d  # the full square


def test_bench_gpt2_tiny_counts_causal_attention_as_half():
    """``loomax bench --config_path config/bench/gpt2_tiny.yaml`` reports 3 x forward."""
    config = parse_config(TrainLmConfig, REPO / "config/bench/gpt2_tiny.yaml").model
    assert 3 * config.flops_per_token(config.vocab_size) == 97_641_984
    assert 3 * config.flops_per_token(config.vocab_size, causal=False) == 99_214_848


def test_causal(model):
    a = tokens()
    b = hax.named(a.array.at[:, 10:].set((a.array[:, 10:] + 1) % VOCAB), a.axes)
    la, lb = logits_of(model, a).array, logits_of(model, b).array
    np.testing.assert_allclose(la[:, :10], lb[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(la[:, 10:], lb[:, 10:])


def test_remat_does_not_change_values():
    batch = tokens()
    plain = Gpt2Config(
        seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, gradient_checkpointing=False
    )
    g1 = loss_grads(build(TINY), batch)
    g2 = loss_grads(build(plain), batch)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_gradient_matches_finite_differences():
    with jax.enable_x64(True):
        config = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2)
        model = eqx.filter_jit(
            lambda: jax.tree.map(
                lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x,
                config.build(23, key=jax.random.PRNGKey(1)),
            )
        )()
        batch = hax.named(
            jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, 23), ("batch", "position")
        )

        def loss(m):
            total, weight = next_token_loss(m, batch)
            return total / weight

        grads = eqx.filter_jit(jax.grad(loss))(model)
        params, unflatten = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))
        flat_grads, _ = ravel_pytree(eqx.filter(grads, eqx.is_inexact_array))
        static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

        @jax.jit
        def bumped_loss(index, eps):  # the loss with one parameter moved by eps
            return loss(eqx.combine(unflatten(params.at[index].add(eps)), static))

        rng = np.random.default_rng(0)
        eps = 1e-6
        for index in rng.choice(params.size, size=12, replace=False):
            plus, minus = bumped_loss(index, eps), bumped_loss(index, -eps)
            numeric = (plus - minus) / (2 * eps)
            np.testing.assert_allclose(flat_grads[index], numeric, rtol=1e-4, atol=1e-8)
