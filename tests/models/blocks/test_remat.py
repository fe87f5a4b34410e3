"""Remat policies that keep named activations: same gradients, less recomputation, checked keys."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import Gpt2Config, LlamaConfig, next_token_loss
from loomax.models.blocks.remat import ACTIVATIONS, scan_policy
from loomax.plan.flops import count_step

VOCAB = 67
LLAMA = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)
GPT2 = Gpt2Config(seq_len=32, hidden_dim=32, num_layers=2, num_heads=4)


def tokens():
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 32), 1, VOCAB)
    return hax.named(ids, ("batch", "position"))


def grad_fn(config):
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    return model, lambda m: jax.grad(lambda m: next_token_loss(m, tokens())[0])(m)


def executed_flops(config) -> float:
    """Matmul FLOPs of the gradient computation, recomputed forward passes included."""
    model, grad = grad_fn(config)
    return count_step(jax.make_jaxpr(grad)(model)).total_flops


@pytest.fixture(scope="module")
def llama_grads():
    model, grad = grad_fn(LLAMA)
    return eqx.filter_jit(grad)(model)


@pytest.mark.parametrize(
    "changes",
    [
        {"remat_save": ("qkv", "attn_out")},
        {"gradient_checkpointing": "offload", "remat_offload": ("mlp_up",)},
        {"gradient_checkpointing": "recompute", "remat_save": ("mlp_in",)},
    ],
    ids=["save", "offload-named", "recompute-save"],
)
def test_named_policies_do_not_change_gradients(llama_grads, changes):
    model, grad = grad_fn(dataclasses.replace(LLAMA, **changes))
    got = eqx.filter_jit(grad)(model)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(llama_grads), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_saved_activations_are_not_recomputed(base):
    """Each layer's forward matmuls run twice under remat; saving the projections (qkv) and
    the MLP's up projections spares their recomputation, and no remat recomputes nothing."""
    remat = executed_flops(base)
    save_qkv = executed_flops(dataclasses.replace(base, remat_save=("qkv",)))
    save_more = executed_flops(dataclasses.replace(base, remat_save=("qkv", "mlp_up")))
    no_remat = executed_flops(dataclasses.replace(base, gradient_checkpointing=False))
    assert remat > save_qkv > save_more >= no_remat
    d, L, tokens_ = base.hidden_dim, base.num_layers, 2 * 32
    kv = base.kv_heads * base.head_size if isinstance(base, LlamaConfig) else d
    qkv_flops = 2 * tokens_ * d * (d + 2 * kv) * L  # the q, k and v projections, once
    assert remat - save_qkv == pytest.approx(qkv_flops, rel=1e-6)


def test_policies_map_onto_haliax():
    assert scan_policy(True).simple
    offload = scan_policy("offload", ("qkv",), ("attn_out",))
    assert offload.save_carries == "offload" and offload.save_inputs is False
    assert offload.save_block_internals == ("qkv",) and offload.offload_block_internals == (
        "attn_out",
    )
    hash(offload)  # a static field of the model: must hash


def test_bad_remat_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"model.remat_save: unknown activation\(s\) \['qkvs'\]"):
        LlamaConfig(remat_save=("qkvs",))
    with pytest.raises(ConfigError, match="model.remat_offload needs model.gradient_checkpointing"):
        LlamaConfig(gradient_checkpointing=False, remat_offload=("qkv",))
    with pytest.raises(ConfigError, match=r"both name \['qkv'\]"):
        LlamaConfig(remat_save=("qkv",), remat_offload=("qkv",))
    assert LlamaConfig(remat_save=["qkv"]).remat_save == ("qkv",)  # lists become tuples
    assert set(ACTIVATIONS) >= {"qkv", "attn_out", "mlp_in", "mlp_up", "splash_residuals"}
