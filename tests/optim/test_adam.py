"""AdamW: the weight-decay mask (linear weights only) and clipping."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loomax.models import Gpt2Config
from loomax.optim import AdamConfig, weight_decay_mask

MODEL = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2).build(
    30, key=jax.random.PRNGKey(0)
)


def test_mask_decays_linear_weights_only():
    mask = weight_decay_mask(MODEL)
    assert mask.blocks.stacked.attn.qkv.weight is True
    assert mask.blocks.stacked.mlp.down.weight is True
    assert mask.blocks.stacked.attn.qkv.bias.array is False
    assert mask.blocks.stacked.ln_attn.weight.array is False
    assert mask.token_embeddings.weight is False and mask.position_embeddings.weight is False
    assert weight_decay_mask(MODEL, decay_embeddings=True).token_embeddings.weight is True


def test_zero_gradient_update_is_pure_decay_on_masked_leaves():
    config = AdamConfig(learning_rate=0.1, weight_decay=0.5, warmup=0, lr_schedule="constant")
    tx = config.build(10)
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, state, params)
    w = params.blocks.stacked.mlp.up.weight.array
    np.testing.assert_allclose(
        updates.blocks.stacked.mlp.up.weight.array, -0.1 * 0.5 * w, rtol=1e-6
    )
    assert not np.any(updates.blocks.stacked.mlp.up.bias.array)
    assert not np.any(updates.token_embeddings.weight.array)


def _first_moment(state):
    """Adam's first moment ``mu`` in an optimizer state (after one step: (1 - b1) * gradient seen)."""
    found = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0].mu


@pytest.mark.parametrize("scale, clipped", [(1e6, True), (1e-4, False)])
def test_clipping_scales_the_gradient_adam_sees(scale, clipped):
    """Adam's first update is about -lr * sign(g) at any scale, so look at the gradient it
    received: its global norm is max_grad_norm when the raw norm is above it, else unchanged."""
    config = AdamConfig(
        learning_rate=1.0, weight_decay=0.0, warmup=0, max_grad_norm=0.5, lr_schedule="constant"
    )
    tx = config.build(10)
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    grads = jax.tree.map(lambda p: jnp.full_like(p, scale), params)
    raw_norm = float(optax.tree.norm(grads))
    _, state = tx.update(grads, tx.init(params), params)
    seen = jax.tree.map(lambda m: m / (1 - config.beta1), _first_moment(state))
    seen_norm = float(optax.tree.norm(seen))
    np.testing.assert_allclose(seen_norm, 0.5 if clipped else raw_norm, rtol=1e-5)
    direction = jax.tree.map(lambda s, g: s / seen_norm - g / raw_norm, seen, grads)
    assert float(optax.tree.norm(direction)) < 1e-5  # clipping rescales, never turns


@pytest.mark.parametrize(
    "field, value",
    [("beta1", 1.0), ("learning_rate", 0.0), ("min_lr_ratio", 2.0), ("max_grad_norm", -1.0)],
)
def test_invalid_fields(field, value):
    with pytest.raises(ValueError, match=f"optimizer.{field}"):
        AdamConfig(**{field: value})
