"""The pure train step: loss decreases, microbatch accumulation equals the full batch, JitHooks."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from loomax.lm import lm_loss
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.train import JitHook, TrainerState, make_train_step
from loomax.train.step import TRACED

CONFIG = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
VOCAB = 50
F32 = jmp.get_policy("f32")


def fresh_state(optimizer):
    model = CONFIG.build(VOCAB, key=jax.random.PRNGKey(0))
    return TrainerState(
        jnp.zeros((), jnp.int32),
        model,
        optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
        jax.random.PRNGKey(1),
    )


def batch(n=8, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (n, CONFIG.seq_len), dtype=np.int32)


def test_loss_decreases_on_a_fixed_batch():
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0, weight_decay=0.0).build(30)
    step = jax.jit(make_train_step(lm_loss(), optimizer, mp=F32))
    state, data = fresh_state(optimizer), batch()
    losses = []
    for _ in range(30):
        state, metrics = step(state, data)
        losses.append(float(metrics["train/loss"]))
    assert losses[0] == pytest.approx(np.log(VOCAB), rel=0.1)
    assert losses[-1] < 0.5 * losses[0]
    assert int(state.step) == 30


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatch_accumulation_equals_full_batch(microbatches):
    # SGD keeps parameters proportional to gradients (Adam would amplify float noise in ~0 grads).
    # Not bitwise: the accumulated gradient sums microbatch means in another order than the
    # full batch's single reduction, so float32 results differ in the last bits.
    optimizer = optax.sgd(0.5)
    full = jax.jit(make_train_step(lm_loss(), optimizer, mp=F32))
    accumulated = jax.jit(
        make_train_step(lm_loss(), optimizer, mp=F32, num_microbatches=microbatches)
    )
    s_full, s_acc = fresh_state(optimizer), fresh_state(optimizer)
    for i in range(3):
        data = batch(seed=i)
        s_full, m_full = full(s_full, data)
        s_acc, m_acc = accumulated(s_acc, data)
        np.testing.assert_allclose(m_acc["train/loss"], m_full["train/loss"], rtol=1e-5)
        np.testing.assert_allclose(m_acc["optim/grad_norm"], m_full["optim/grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s_full.model), jax.tree.leaves(s_acc.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_metrics_include_learning_rate_and_grad_norm():
    config = AdamConfig(learning_rate=1e-3, warmup=4, lr_schedule="constant")
    optimizer = config.build(10)
    step = jax.jit(
        make_train_step(lm_loss(), optimizer, mp=F32, lr_schedule=config.lr_scheduler(10))
    )
    state = fresh_state(optimizer)
    lrs = []
    for _ in range(5):
        state, metrics = step(state, batch())
        lrs.append(float(metrics["optim/learning_rate"]))
        assert float(metrics["optim/grad_norm"]) > 0
    np.testing.assert_allclose(lrs, [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3], rtol=1e-6)


def test_bf16_compute_keeps_f32_params():
    optimizer = AdamConfig(learning_rate=1e-3).build(10)
    step = jax.jit(make_train_step(lm_loss(), optimizer, mp=jmp.get_policy("p=f32,c=bfloat16")))
    start = fresh_state(optimizer)
    state, metrics = step(start, batch())
    assert state.model.token_embeddings.weight.dtype == jnp.float32
    assert metrics["train/loss"].dtype == jnp.float32
    _, f32_metrics = jax.jit(make_train_step(lm_loss(), optimizer, mp=F32))(start, batch())
    # the same loss as in float32, up to bfloat16's 8-bit mantissa
    assert float(metrics["train/loss"]) == pytest.approx(float(f32_metrics["train/loss"]), rel=2e-2)
    before = np.asarray(start.model.token_embeddings.weight.array)
    assert not np.array_equal(np.asarray(state.model.token_embeddings.weight.array), before)


def test_jit_hook_metrics_every_n():
    optimizer = AdamConfig(learning_rate=1e-3).build(10)
    hook = JitHook(
        lambda ctx: {"grads/embed_norm": jnp.linalg.norm(ctx.grads.token_embeddings.weight.array)},
        every=2,
    )
    step = jax.jit(make_train_step(lm_loss(), optimizer, mp=F32, jit_hooks=[hook]))
    state = fresh_state(optimizer)
    values = []
    for _ in range(4):
        state, metrics = step(state, batch())
        (traced,) = metrics[TRACED]  # the JitHook outputs travel apart from the shared metrics
        assert "grads/embed_norm" not in metrics
        values.append(float(traced["grads/embed_norm"]))
    assert values[1] > 0 and values[3] > 0  # steps 2 and 4 (counted from 1) are divisible by 2
    assert values[0] == 0 and values[2] == 0
