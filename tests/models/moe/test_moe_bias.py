"""Aux-loss-free balancing (``model.moe.bias_update_rate``): the routing bias is a buffer
(no gradient, no optimizer state or update), the step moves it by exactly rate * sign(mean
load - load) from the step's load, it balances a skewed router (rate 0 does not), its spread
is reported under ``moe/``, and it survives a checkpoint: a resumed run equals an
uninterrupted one bitwise."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from loomax.config import ConfigError
from loomax.lm import lm_loss
from loomax.models import MixtralConfig, MoeConfig
from loomax.models.blocks.buffers import Buffer, update_state
from loomax.models.loss import next_token_loss_and_metrics
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step, trainable_params

VOCAB, RATE, STEPS = 48, 0.05, 12
MOE = MoeConfig(
    num_experts=4,
    num_experts_per_tok=1,
    load_balance_loss_weight=0.0,
    router_z_loss_weight=0.0,
    bias_update_rate=RATE,
)
TINY = MixtralConfig(seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=2, num_heads=4,
                     num_kv_heads=2, moe=MOE)  # fmt: skip
IDS = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, VOCAB)
OPTIMIZER = optax.adamw(1e-3, weight_decay=0.1)  # weight decay would move a trained bias


def skewed(config):
    """A model whose router is 4x its initial scale: its loads far from balanced."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    w = model.blocks.stacked.mlp.router.weight
    return eqx.tree_at(lambda m: m.blocks.stacked.mlp.router.weight, model, w * 4.0)


def state_of(model):
    opt_state = OPTIMIZER.init(trainable_params(model))
    return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, jax.random.PRNGKey(0))


@functools.cache
def step_fn():
    """The jitted train step (one object: each model config's step is traced and compiled once)."""
    return jax.jit(make_train_step(lm_loss(block_size=None), OPTIMIZER, mp=jmp.get_policy("f32")))


@pytest.fixture(scope="module")
def runs():
    """STEPS steps of the skewed model with and without the bias: (states, load CVs)."""
    out = {}
    for rate in (0.0, RATE):
        config = dataclasses.replace(TINY, moe=dataclasses.replace(MOE, bias_update_rate=rate))
        state, step, cvs = state_of(skewed(config)), step_fn(), []
        first = state
        for _ in range(STEPS):
            state, metrics = step(state, IDS)
            cvs.append(np.mean([float(metrics[f"moe/layer_{i}/load_cv"]) for i in range(2)]))
        out[rate] = (first, state, cvs, metrics)
    return out


def test_the_bias_is_a_buffer_outside_the_optimizer():
    model = skewed(TINY)
    assert isinstance(model.blocks.stacked.mlp.bias, Buffer)
    assert jax.tree.leaves(trainable_params(model).blocks.stacked.mlp.bias) == []  # not trained
    grads = eqx.filter_jit(jax.grad(lambda m: next_token_loss_and_metrics(m, hax.named(IDS, ("batch", "position")), block_size=None)[0][0]))(model)  # fmt: skip
    assert not np.any(grads.blocks.stacked.mlp.bias.value.array)  # the choice only: no gradient
    assert skewed(dataclasses.replace(TINY, moe=dataclasses.replace(MOE, bias_update_rate=0.0))).blocks.stacked.mlp.bias is None  # fmt: skip


def test_one_step_moves_the_bias_by_rate_times_sign_of_the_load_gap(runs):
    first = runs[RATE][0]
    _, aux = eqx.filter_jit(lambda m: m.hidden_states_and_aux(hax.named(IDS, ("batch", "position"))))(first.model)  # fmt: skip
    load = np.asarray(aux.state["moe_load"])
    want = RATE * np.sign(load.mean(-1, keepdims=True) - load)
    after, _ = step_fn()(first, IDS)
    got = after.model.blocks.stacked.mlp.bias.value.rearrange(("layers", "experts")).array
    np.testing.assert_array_equal(got, want.astype(np.float32))  # no Adam, no weight decay
    assert np.any(want)
    assert update_state(first.model, {}) is first.model


def test_the_bias_balances_a_skewed_router(runs):
    _, _, off, _ = runs[0.0]
    _, final, on, metrics = runs[RATE]
    assert on[0] == off[0] and on[0] > 0.25  # the same skewed start
    assert np.mean(on[-4:]) < 0.5 * np.mean(off[-4:]), (on, off)
    bias = final.model.blocks.stacked.mlp.bias.value.rearrange(("layers", "experts")).array
    spread = np.asarray(bias.max(-1) - bias.min(-1))
    assert float(metrics["moe/router_bias_spread"]) > 0  # the spread before the last update
    assert "moe/layer_1/router_bias_spread" in metrics and spread.min() > 0
    assert "moe/router_bias_spread" not in runs[0.0][3]


def test_negative_rate_is_a_config_error():
    with pytest.raises(ConfigError, match="model.moe.bias_update_rate"):
        MoeConfig(bias_update_rate=-0.1)


def test_export_refuses_a_routing_bias():
    with pytest.raises(ConfigError, match="model.moe.bias_update_rate"):
        TINY.hf_config(VOCAB)


def test_a_resumed_run_continues_the_bias_bitwise(tmp_path, resume_helpers):
    h = resume_helpers

    def run(where, stop=None):
        trainer = h.make_trainer(where, model=TINY, num_train_steps=8)
        if stop is not None:
            trainer.add_hook(h.terminate_at(stop))
        state, batches = h.start(trainer)
        start = int(state.step), np.asarray(state.model.blocks.stacked.mlp.bias.value.array)
        return trainer.train(state, batches), start

    full, _ = run(tmp_path / "full")
    part, _ = run(tmp_path / "part", stop=4)
    assert part.step == 4
    resumed, (step, bias) = run(tmp_path / "part")
    assert step == 4 and np.any(bias)  # the bias came back from the checkpoint
    assert np.any(full.state.model.blocks.stacked.mlp.bias.value.array)
    for a, b in zip(h.params(resumed.state), h.params(full.state), strict=True):
        np.testing.assert_array_equal(a, b)
