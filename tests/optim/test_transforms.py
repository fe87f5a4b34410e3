"""The small transforms and options the optimizers are chained from."""

from __future__ import annotations

from dataclasses import replace

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig, MuonConfig, SkipBadStepsConfig, regex_mask
from loomax.optim.global_norm import clip_by_global_norm, global_norm
from loomax.optim.muon import muon_labels
from loomax.optim.newton_schulz import newton_schulz
from loomax.optim.transforms import clip_update_norm, clip_update_rms

MODEL = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2).build(
    30, key=jax.random.PRNGKey(0)
)
PARAMS = eqx.filter(MODEL, eqx.is_inexact_array)


def test_update_rms_clipping_caps_each_leaf():
    tx = clip_update_rms(0.5)
    updates = {"big": jnp.full((4,), 2.0), "small": jnp.full((4,), 0.1)}
    out, _ = tx.update(updates, tx.init(updates))
    np.testing.assert_allclose(out["big"], 0.5)
    np.testing.assert_allclose(out["small"], 0.1)


def test_global_norm_and_its_clipping_equal_optaxs():
    # summed per row of the first axis, then in order (the same bits at any sharding: the
    # staged resume in tests/models/blocks/test_pipeline.py); the value is optax's
    tree = {
        "stacked": jnp.arange(24.0).reshape(2, 3, 4) / 7,
        "bias": jnp.array([3.0, -4.0]),
        "scale": jnp.array(2.0),
    }
    np.testing.assert_allclose(global_norm(tree), optax.tree.norm(tree), rtol=1e-6)
    for max_norm in (1.0, 1e3):  # clipped, then not
        ours, _ = clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        theirs, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clip_update_norm_uses_the_history():
    tx = clip_update_norm(window=4, sigma_factor=1.0)
    state = tx.init(None)
    norms = []
    for value in [1.0, 1.1, 0.9, 1.0, 50.0, 1.0]:
        out, state = tx.update({"u": jnp.array([value])}, state)
        norms.append(float(jnp.abs(out["u"][0])))
    assert norms[:4] == pytest.approx([1.0, 1.1, 0.9, 1.0])  # window not full yet: untouched
    history = np.array([1.0, 1.1, 0.9, 1.0])
    assert norms[4] == pytest.approx(history.mean() + history.std(), rel=1e-5)  # the spike
    assert norms[5] == pytest.approx(1.0)


def test_newton_schulz_orthogonalises():
    g = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 16))
    x = newton_schulz(g, 10)
    singular = np.linalg.svd(np.asarray(x), compute_uv=False)
    assert np.all((singular > 0.6) & (singular < 1.3))  # the quintic's band around 1
    tall = newton_schulz(jnp.swapaxes(g, -1, -2), 10)
    np.testing.assert_allclose(tall, jnp.swapaxes(x, -1, -2), atol=1e-5)


def test_muon_orthogonalises_linear_weights_and_uses_adam_elsewhere():
    labels = muon_labels(PARAMS)
    assert labels.blocks.stacked.mlp.up.weight == "muon"
    assert labels.blocks.stacked.mlp.up.bias == "adam"
    assert labels.token_embeddings.weight == "adam"
    tx = MuonConfig(learning_rate=1.0, weight_decay=0.0, warmup=0, lr_schedule="constant").build(10)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, PARAMS)
    up_grad = jax.random.normal(
        jax.random.PRNGKey(2), PARAMS.blocks.stacked.mlp.up.weight.array.shape
    )
    grads = eqx.tree_at(
        lambda g: g.blocks.stacked.mlp.up.weight,
        grads,
        hax.NamedArray(up_grad, PARAMS.blocks.stacked.mlp.up.weight.axes),
    )
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    up: hax.NamedArray = updates.blocks.stacked.mlp.up.weight
    layer0 = np.asarray(up.array[0]).reshape(up.array.shape[1], -1)  # (mlp, embed) per layer
    singular = np.linalg.svd(layer0, compute_uv=False)
    scale = 0.2 * max(layer0.shape) ** 0.5
    assert np.all(np.abs(singular / scale) < 1.3) and np.all(singular / scale > 0.5)
    # Adam's first step on a constant gradient is sign-like: -lr * ~1 for every entry
    np.testing.assert_allclose(updates.token_embeddings.weight.array, -1.0, rtol=1e-4)


def test_regex_weight_decay_modules():
    mask = regex_mask(PARAMS, [r"attn\.qkv\.weight", "token_embeddings"])
    assert mask.blocks.stacked.attn.qkv.weight.array is True
    assert mask.token_embeddings.weight.array is True
    assert mask.blocks.stacked.mlp.up.weight.array is False
    config = AdamConfig(
        learning_rate=0.1, weight_decay=0.5, warmup=0, lr_schedule="constant", max_grad_norm=None
    )
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)

    def decayed(cfg):
        tx = cfg.build(10)
        updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
        return updates

    regex = decayed(replace(config, weight_decay_modules="token_embeddings"))
    assert np.any(regex.token_embeddings.weight.array)
    assert not np.any(regex.blocks.stacked.mlp.up.weight.array)
    everything = decayed(replace(config, default_weight_decay_mask=False))
    assert np.any(everything.blocks.stacked.ln_mlp.weight.array)  # norms decay too
    with pytest.raises(ValueError, match="weight_decay_modules"):
        regex_mask(PARAMS, "(")


def test_adamc_keeps_weight_decay_over_lr_constant():
    # linear decay 1.0 -> 0.5 at the midpoint: plain AdamW decays by lr * wd, AdamC by lr^2 / peak * wd
    base = dict(learning_rate=1.0, weight_decay=0.1, warmup=0, lr_schedule="linear")
    base.update(min_lr_ratio=0.0, max_grad_norm=None)
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    w = PARAMS.blocks.stacked.mlp.up.weight.array

    def update_at(step, **kw):
        tx = AdamConfig(**base, **kw).build(10)
        state = tx.init(PARAMS)
        for _ in range(step):
            _, state = tx.update(zeros, state, PARAMS)
        updates, _ = tx.update(zeros, state, PARAMS)
        return updates.blocks.stacked.mlp.up.weight.array

    np.testing.assert_allclose(update_at(5), -0.5 * 0.1 * w, rtol=1e-5)
    np.testing.assert_allclose(
        update_at(5, adamc_weight_decay=True), -0.5 * 0.5 * 0.1 * w, rtol=1e-5
    )


def test_lr_scales_with_sqrt_of_batch_growth():
    batches = BatchSchedule([BatchStage(0, 8), BatchStage(5, 32)])
    config = AdamConfig(
        learning_rate=1.0, warmup=0, lr_schedule="constant", scale_lr_with_batch="sqrt"
    )
    lr = config.lr_scheduler(10, batches)
    assert float(lr(4)) == pytest.approx(1.0) and float(lr(5)) == pytest.approx(2.0)
    linear = replace(config, scale_lr_with_batch="linear")
    assert float(linear.lr_scheduler(10, batches)(7)) == pytest.approx(4.0)
    plain = replace(config, scale_lr_with_batch="none")
    assert float(plain.lr_scheduler(10, batches)(7)) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("false", None),
        ("true", SkipBadStepsConfig()),
        ("50", SkipBadStepsConfig(rolling_interval_length=50)),
        (
            "{rolling_interval_length: 20, sigma_factor: 3, min_history: 5}",
            SkipBadStepsConfig(rolling_interval_length=20, sigma_factor=3, min_history=5),
        ),
    ],
)
def test_skip_bad_steps_forms(value, expected):
    config = parse_config(TrainLmConfig, None, ["--optimizer.skip_bad_steps", value])
    assert config.optimizer.skip_bad_steps_config() == expected


def test_skip_bad_steps_min_history_is_honoured():
    """min_history (the old hook's knob) reaches the transform: with 2 it skips at step 3."""
    config = AdamConfig(
        learning_rate=0.1,
        warmup=0,
        lr_schedule="constant",
        skip_bad_steps=SkipBadStepsConfig(rolling_interval_length=4, min_history=2),
    )
    tx = config.build(100)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for loss in [1.0, 1.01]:
        _, state = tx.update({"w": jnp.full(3, 0.1)}, state, params, value=jnp.float32(loss))
    updates, after = tx.update({"w": jnp.full(3, 0.1)}, state, params, value=jnp.float32(100.0))
    assert not np.any(updates["w"]) and int(after.skipped) == 1


def test_skipped_step_leaves_params_and_state_alone():
    config = AdamConfig(learning_rate=0.1, warmup=0, skip_bad_steps=4, lr_schedule="constant")
    tx = config.build(100)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for loss in [1.0, 1.01, 0.99, 1.0, 1.0, 1.01, 0.99, 1.0, 1.0, 1.0]:
        _, state = tx.update({"w": jnp.full(3, 0.1)}, state, params, value=jnp.float32(loss))
    updates, after = tx.update({"w": jnp.full(3, 0.1)}, state, params, value=jnp.float32(100.0))
    assert not np.any(updates["w"]) and int(after.skipped) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("scale_lr_with_batch", "cube"),
        ("update_rms_clipping", 0.0),
        ("skip_bad_steps", 1),
        ("timescale", -1.0),
        ("decay", -0.5),
    ],
)
def test_invalid_fields(field, value):
    with pytest.raises(ValueError, match=f"optimizer.{field}"):
        AdamConfig(**{field: value})


def test_linear_with_only_in_out_axes_is_not_batched():
    linear = hnn.Linear.init(hax.Axis("embed", 4), hax.Axis("mlp", 6), key=jax.random.PRNGKey(0))
    params = eqx.filter(linear, eqx.is_inexact_array)
    assert muon_labels(params).weight == "muon"
