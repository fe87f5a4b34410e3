"""The loss tail's surrogate: the loop's value exactly, the loop's gradients under autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models.blocks.pipeline_tail import (
    current_tail,
    loss_tail,
    surrogate,
    tail_context,
    wanted,
)
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
    from loomax.models.families.deepseek_v3 import DeepseekV3Config
    from loomax.models.moe.moe import MoeConfig
    from loomax.models.attention.rotary import DefaultRotary

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
