"""Mixtral through the loss and the step: the balance losses join the training loss (and
only it), the router metrics come out under ``moe/`` from the scanned and the unrolled stack
alike, activation taps still work, and the shipped ``mixtral_tiny`` and ``moe_tiny`` configs parse with the dense model's active width."""

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

from loomax.config import parse_config
from loomax.lm import TrainLmConfig, lm_loss
from loomax.models import MixtralConfig, MoeConfig, next_token_loss
from loomax.models.blocks import taps
from loomax.models.loss import next_token_loss_and_metrics
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step

VOCAB = 41
TINY = MixtralConfig(
    seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, load_balance_loss_weight=0.5,
                  router_z_loss_weight=0.25),
)  # fmt: skip
IDS = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, VOCAB)


@pytest.fixture(scope="module")
def model():
    return TINY.build(VOCAB, key=jax.random.PRNGKey(0))


def named(ids=IDS):
    return hax.named(ids, ("batch", "position"))


@jax.jit
def terms(model):
    with_aux = next_token_loss_and_metrics(model, named(), block_size=None)
    (plain, count), _ = next_token_loss_and_metrics(
        model, named(), block_size=None, aux_losses=False
    )
    return with_aux, plain, count


def test_balance_losses_join_the_training_loss_with_their_weights(model):
    ((total, count), metrics), plain, _ = terms(model)
    lbl, z = metrics["moe/load_balance_loss"], metrics["moe/router_z_loss"]
    assert 1.0 <= float(lbl) < 4.0 and float(z) > 0
    np.testing.assert_allclose(total - plain, count * (0.5 * lbl + 0.25 * z), rtol=1e-5)
    # next_token_loss is the same sum without the metrics
    np.testing.assert_allclose(next_token_loss(model, named(), block_size=None)[0], total)


def test_load_balance_gradient_reaches_the_router(model):
    def router_grad(aux_losses):
        def loss(m):
            (t, n), _ = next_token_loss_and_metrics(
                m, named(), block_size=None, aux_losses=aux_losses
            )
            return t / n

        return jax.jit(jax.grad(loss))(model).blocks.stacked.mlp.router.weight.array

    assert not np.allclose(router_grad(True), router_grad(False), atol=1e-6)


def test_scanned_and_unrolled_stacks_give_the_same_loss_and_metrics(model):
    unrolled = dataclasses.replace(model, config=dataclasses.replace(TINY, scan_layers=False))
    ((a, _), ma), _, _ = terms(model)
    ((b, _), mb), _, _ = terms(unrolled)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert set(ma) == set(mb)
    for name in ma:
        np.testing.assert_allclose(ma[name], mb[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert {"moe/layer_1/load_cv", "moe/layer_0/router_entropy", "moe/dropped_fraction"} <= set(ma)


def test_activation_taps_see_the_residual_stream(model):
    with taps.collect() as recorded:
        jax.eval_shape(lambda m: m.hidden_states(named()), model)
    assert "layer_1/residual" in recorded and "layer_0/mlp_out" in recorded


def test_train_step_reports_router_metrics_under_moe(model):
    optimizer = optax.adam(1e-2)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = TrainerState(
        jnp.zeros((), jnp.int32), model, optimizer.init(params), jax.random.PRNGKey(0)
    )
    policy = jmp.get_policy("f32")
    step = jax.jit(make_train_step(lm_loss(block_size=None), optimizer, mp=policy))
    losses = []
    for _ in range(3):
        state, metrics = step(state, IDS)
        losses.append(float(metrics["train/loss"]))
    assert "moe/layer_0/load_max" in metrics and "train/moe/layer_0/load_max" not in metrics
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["mixtral_tiny", "moe_tiny"])
def test_tiny_moe_configs_parse_with_the_dense_active_width(repo_root, name):
    config = parse_config(TrainLmConfig, repo_root / "config" / f"{name}.yaml").model
    dense = parse_config(TrainLmConfig, repo_root / "config" / "llama_tiny.yaml").model
    assert isinstance(config, MixtralConfig) and config.moe.num_experts > 1
    active = config.expert_dim * (config.moe.num_experts_per_tok + config.moe.num_shared_experts)
    assert active == dense.intermediate_dim and config.hidden_dim == dense.hidden_dim


def test_olmoe_qk_norm_is_the_projection_scope_olmo2_uses():
    """One switch (``qk_norm_scope``) for OLMoE's and OLMo 2's whole-projection QK-norm."""
    from loomax.models import OlmoeConfig
    from loomax.models.families.olmo2 import Olmo2Config

    olmoe = OlmoeConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=8, num_layers=1, num_heads=4, num_kv_heads=2,
        moe=MoeConfig(num_experts=2, num_experts_per_tok=1),
    )  # fmt: skip
    assert OlmoeConfig.qk_norm_scope == Olmo2Config.qk_norm_scope == "projection"
    attn = jax.eval_shape(lambda: olmoe.build(VOCAB, key=jax.random.PRNGKey(0))).blocks
    q_norm = attn.stacked.attn.q_norm.weight
    assert [a.name for a in q_norm.axes] == ["layers", "heads", "head_size"]
    assert not hasattr(olmoe, "qk_norm_over_heads")
