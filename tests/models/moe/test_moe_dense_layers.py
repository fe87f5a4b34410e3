"""Dense first layers of a mixture of experts (``model.moe.first_dense_layers``): the first N
blocks are Llama blocks with a dense MLP, the rest routed; the stack runs them in order,
router statistics cover the routed layers, activation taps name layers in model order, KV-cache
decoding crosses both stacks, FLOPs count each layer as what it is, and bad settings fail."""

from __future__ import annotations

import dataclasses

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
from loomax.models.blocks import taps
from loomax.models.decoding.generate import sample_tokens
from loomax.models.loss import next_token_loss_and_metrics
from loomax.models.moe.moe_routing import RouterAux
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step, trainable_params

VOCAB = 41
CONFIG = MixtralConfig(
    seq_len=16, hidden_dim=16, intermediate_dim=24, num_layers=3, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, first_dense_layers=1,
                  bias_update_rate=0.01),
)  # fmt: skip
IDS = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, VOCAB)


@pytest.fixture(scope="module")
def model():
    return CONFIG.build(VOCAB, key=jax.random.PRNGKey(0))


def named(ids=IDS):
    return hax.named(ids, ("batch", "position"))


def test_the_first_layers_are_dense_blocks_run_before_the_routed_ones(model):
    assert model.dense_blocks.Block.size == 1 and model.blocks.Block.size == 2
    assert model.dense_blocks.stacked.mlp.gate_proj.weight.axis_size("mlp") == 24

    @eqx.filter_jit  # each side one program, not op by op
    def by_hand(model):  # the stack by hand: embed, the dense block, the routed blocks, the norm
        x = model.embed_tokens.embed(named())
        x = model.dense_blocks.unstacked()[0](x, layer=jnp.int32(0))
        carry = (x, RouterAux.zeros(2, 4))
        for i, block in enumerate(model.blocks.unstacked()):
            carry = block(carry, layer=i)
        return model.norm(carry[0]).array

    whole = eqx.filter_jit(lambda m: m.hidden_states(named()).array)
    np.testing.assert_allclose(by_hand(model), whole(model), rtol=1e-5, atol=1e-6)


def test_router_statistics_and_taps_follow_the_layers(model):
    (_, _), metrics = next_token_loss_and_metrics(model, named(), block_size=None)
    assert {"moe/layer_0/load_cv", "moe/layer_1/load_cv"} <= set(metrics)
    assert "moe/layer_2/load_cv" not in metrics  # two routed layers
    with taps.collect() as recorded:
        jax.eval_shape(lambda m: m.hidden_states(named()), model)
    assert {f"layer_{i}/residual" for i in range(3)} <= set(recorded)
    assert "layer_0/mlp_out" in recorded and "layer_2/mlp_out" in recorded


def test_greedy_with_cache_equals_without(model):
    args = dict(seq_len=16, max_new_tokens=8, temperature=0.0, key=jax.random.PRNGKey(0))
    cached = sample_tokens(model, [3, 1, 4], **args)
    assert cached == sample_tokens(model, [3, 1, 4], use_cache=False, **args)


def test_training_moves_both_stacks_and_the_bias(model):
    optimizer = optax.adam(1e-2)
    state = TrainerState(
        jnp.zeros((), jnp.int32), model, optimizer.init(trainable_params(model)),
        jax.random.PRNGKey(0),
    )  # fmt: skip
    step = jax.jit(make_train_step(lm_loss(block_size=None), optimizer, mp=jmp.get_policy("f32")))
    losses = []
    for _ in range(3):
        state, metrics = step(state, IDS)
        losses.append(float(metrics["train/loss"]))
    assert losses[-1] < losses[0]
    moved = jax.tree.map(
        lambda a, b: not bool(jnp.array_equal(a, b)),
        eqx.filter(state.model.dense_blocks, eqx.is_array),
        eqx.filter(model.dense_blocks, eqx.is_array),
    )
    assert all(jax.tree.leaves(moved))
    assert state.model.blocks.stacked.mlp.bias.value.array.shape == (2, 4)


def test_flops_count_dense_layers_as_dense():
    d, routed = (
        16,
        dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, first_dense_layers=0)),
    )
    moe_mlp = 2 * 3 * d * 24 * 2 + 2 * d * 4  # two experts and the router
    dense_mlp = 2 * 3 * d * 24
    assert routed.flops_per_token(VOCAB) - CONFIG.flops_per_token(VOCAB) == moe_mlp - dense_mlp


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="first_dense_layers .3. must be less than"):
        dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, first_dense_layers=3))
    with pytest.raises(ConfigError, match="first_dense_layers must be >= 0"):
        MoeConfig(first_dense_layers=-1)
    plain = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, bias_update_rate=0.0))
    with pytest.raises(ConfigError, match="model.moe.first_dense_layers: 0"):
        plain.hf_config(VOCAB)
