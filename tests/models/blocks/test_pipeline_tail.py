"""The loss tail's surrogate (the loop's value exactly, the loop's gradients under autodiff),
its router losses for a mixture of experts, and the models it refuses."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import MixtralConfig
from loomax.models.attention.rotary import DefaultRotary
from loomax.models.blocks.pipeline_tail import (
    current_tail,
    loss_tail,
    surrogate,
    tail_context,
    wanted,
)
from loomax.models.families.deepseek_v3 import DeepseekV3Config
from loomax.models.moe.moe import MoeConfig
from loomax.models.moe.moe_routing import RouterAux
from loomax.stages import PipelineConfig, pipelining


def test_surrogate_has_the_loss_value_and_the_given_gradients():
    def f(params):
        loss = jnp.float32(2.5)  # as the loop computes it: no path to params
        grads = {"a": jnp.array([1.0, -2.0]), "b": jnp.array(3.0)}
        return surrogate(loss, [(params, grads)])

    params = {"a": jnp.array([0.5, 0.25]), "b": jnp.array(7.0)}
    value, grads = jax.value_and_grad(f)(params)
    assert value == 2.5
    np.testing.assert_array_equal(grads["a"], [1.0, -2.0])
    assert grads["b"] == 3.0


def test_no_tail_without_stages_or_a_loss_in_loop_schedule():
    assert loss_tail(object(), None, None, None, stages=1) is None
    assert loss_tail(object(), None, None, None, stages=4) is None  # gpipe, the default
    with tail_context(None):
        assert current_tail() is None


def test_a_model_without_its_last_layer_apart_is_refused_by_name():
    with pipelining(PipelineConfig(schedule="1f1b")):
        assert wanted(4) and not wanted(1)
        with pytest.raises(ConfigError, match="'1f1b': object has no final_hidden"):
            loss_tail(object(), None, None, None, stages=4)


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"first_dense_layers": 1}, "dense first layers"), ({"mtp": 1}, "multi-token prediction")],
)
def test_a_second_stack_or_multi_token_prediction_is_refused_by_name(fields, match):
    # the loss inside the loop runs one staged stack and keeps its output inside the loop
    moe = MoeConfig(
        num_experts=4, num_experts_per_tok=2, expert_intermediate_dim=8,
        first_dense_layers=fields.get("first_dense_layers", 0),
    )  # fmt: skip
    config = DeepseekV3Config(
        seq_len=8, hidden_dim=16, intermediate_dim=16, num_layers=2, num_heads=2, q_lora_rank=8,
        kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        mtp_depth=fields.get("mtp", 0), rope=DefaultRotary(theta=10000.0), moe=moe,
    )  # fmt: skip
    model = jax.eval_shape(lambda: config.build(32, key=jax.random.PRNGKey(0)))  # shapes only
    with pipelining(PipelineConfig(schedule="zero_bubble")):
        with pytest.raises(ConfigError, match=match):
            loss_tail(model, None, None, None, stages=2)


def test_a_mixture_of_experts_tail_carries_its_router_losses():
    # each chunk's backward differentiates tokens / m x aux_loss of its rows: the weighted
    # layer means of the balance and z losses (the model's router_losses), off without aux losses
    moe = MoeConfig(
        num_experts=4, num_experts_per_tok=2, expert_intermediate_dim=8,
        load_balance_loss_weight=0.5, router_z_loss_weight=0.25,
    )  # fmt: skip
    config = MixtralConfig(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2, moe=moe)
    model = jax.eval_shape(lambda: config.build(32, key=jax.random.PRNGKey(0)))
    targets = hax.zeros((hax.Axis("batch", 2), hax.Axis("position", 8)), jnp.int32)
    weights = hax.ones(targets.axes)
    stats = RouterAux.zeros(2, 4)
    stats = eqx.tree_at(lambda a: (a.balance, a.z), stats, (jnp.array([1.0, 0]), jnp.ones(2)))
    with pipelining(PipelineConfig(schedule="1f1b")):
        tail = loss_tail(model, None, targets, weights, stages=2)
        assert float(tail.aux_loss(stats)) == pytest.approx(0.5 * 0.5 + 0.25 * 1.0)
        assert loss_tail(model, None, targets, weights, 2, aux_losses=False).aux_loss is None


def test_gpt2_hands_its_final_layer_norm_to_the_tail():
    from loomax.models import Gpt2Config

    config = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2)
    model = jax.eval_shape(lambda: config.build(32, key=jax.random.PRNGKey(0)))
    targets = hax.zeros((hax.Axis("batch", 2), hax.Axis("position", 8)), jnp.int32)
    with pipelining(PipelineConfig(schedule="1f1b")):
        tail = loss_tail(model, None, targets, hax.ones(targets.axes), stages=2)
    assert tail.aux_loss is None and tail.params.blocks is None  # the model without its blocks
    assert tail.params.ln_final.weight.shape == {"embed": 16}
