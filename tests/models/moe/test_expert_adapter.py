"""Per-expert low-rank adapters on the MoE layer (models/moe/expert_adapter.py, through
expert_ffn): the ``blocked`` grouped matmul (the CPU path) and ``ragged_dot`` compute the
same adapted layer and the same adapter gradients; the adapted layer equals the layer with
the adapters merged into its weights; fresh adapters (B = 0) leave it bit for bit as it was."""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis

from loomax.models.lora.config import LoraConfig
from loomax.models.lora.experts import adapt_experts, merge_experts
from loomax.models.moe.expert_adapter import ExpertAdapter
from loomax.models.moe.moe import MoeConfig, MoeMlp
from loomax.train.step import trainable_mask

EMBED = Axis("embed", 16)
X = hax.random.normal(jax.random.PRNGKey(1), (Axis("batch", 2), Axis("position", 8), EMBED))
LORA = LoraConfig(targets=("mlp",), rank=3, alpha=6.0)
COTANGENT = jax.random.normal(jax.random.PRNGKey(2), X.array.shape)


def layer(matmul: str, trained: bool = True) -> MoeMlp:
    moe = MoeConfig(num_experts=4, num_experts_per_tok=2, matmul=matmul, matmul_block=4)
    mlp = MoeMlp.init(moe, EMBED, 24, "silu", 1.0, key=jax.random.PRNGKey(0))
    mlp = adapt_experts(mlp, "mlp", [re.compile("mlp")], LORA, jax.random.PRNGKey(3))
    if not trained:
        return mlp

    def bump(adapter):
        b = hax.random.normal(jax.random.PRNGKey(4), adapter.lora_b.axes) * 0.5
        return eqx.tree_at(lambda m: m.lora_b, adapter, b)

    is_adapter = lambda x: isinstance(x, ExpertAdapter)  # noqa: E731
    return jax.tree.map(lambda n: bump(n) if is_adapter(n) else n, mlp, is_leaf=is_adapter)


def objective(adapters, rest):
    out, _ = eqx.combine(adapters, rest)(X)
    return jnp.sum(out.array * COTANGENT), out.array


def split(mlp):
    """(the adapters, the rest): what model.lora's freeze trains and keeps."""
    return eqx.partition(mlp, trainable_mask(mlp, LORA.freeze_patterns()))


@pytest.fixture(scope="module")
def results():
    grad = jax.jit(jax.value_and_grad(objective, has_aux=True))
    return {m: grad(*split(layer(m))) for m in ("blocked", "ragged_dot")}


def test_blocked_and_ragged_dot_give_the_same_adapted_layer_and_gradients(results):
    (_, got), got_grads = results["blocked"]
    (_, want), want_grads = results["ragged_dot"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    leaves = list(zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True))
    assert len(leaves) == 6  # A and B of gate, up and down
    for a, b in leaves:
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_adapted_layer_equals_its_merged_weights(results):
    (_, got), _ = results["blocked"]
    merged = merge_experts(layer("blocked"))
    assert merged.up_lora is None
    np.testing.assert_allclose(got, np.asarray(merged(X)[0].array), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul", ["blocked", "ragged_dot"])
def test_fresh_adapters_leave_the_layer_exactly(matmul):
    fresh = layer(matmul, trained=False)
    base = dataclasses.replace(fresh, gate_lora=None, up_lora=None, down_lora=None)
    np.testing.assert_array_equal(np.asarray(fresh(X)[0].array), np.asarray(base(X)[0].array))
