"""Experts with biases and gpt-oss's clamped SwiGLU (``model.moe.expert_bias``,
``swiglu_limit``): the layer's output and every gradient (biases, weights, router, input)
equal a dense reference that runs every expert on every token, with the clamp active; a
dropped assignment (``capacity_factor``) adds no down-projection bias."""

from __future__ import annotations

import dataclasses
from operator import attrgetter

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.axes import Embed, Experts, Mlp
from loomax.models.moe.moe import MoeConfig, MoeMlp

D, M, E, K, T = 8, 12, 4, 2, 24
MOE = MoeConfig(num_experts=E, num_experts_per_tok=K, expert_bias=True, swiglu_limit=0.7)


def layer(moe=MOE):
    mlp = MoeMlp.init(moe, hax.Axis(Embed, D), M, "silu", 1.0, key=jax.random.PRNGKey(0))
    leaves, tree = jax.tree.flatten(mlp)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree.unflatten(
        tree, [x + jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


def dense(mlp: MoeMlp, x: jax.Array) -> jax.Array:
    """Every expert on every token, weighted by the softmax of the top k router logits."""
    arr = lambda a, axes: a.rearrange(axes).array  # noqa: E731
    logits = x @ arr(mlp.router.weight, (Embed, Experts)) + mlp.router.bias.array
    top, idx = jax.lax.top_k(logits, K)
    weights = jnp.zeros_like(logits).at[jnp.arange(T)[:, None], idx].set(jax.nn.softmax(top))
    g = jnp.einsum("td,edm->tem", x, arr(mlp.gate, (Experts, Embed, Mlp)))
    u = jnp.einsum("td,edm->tem", x, arr(mlp.up, (Experts, Embed, Mlp)))
    g = jnp.minimum(g + arr(mlp.gate_bias, (Experts, Mlp)), 0.7)
    u = jnp.clip(u + arr(mlp.up_bias, (Experts, Mlp)), -0.7, 0.7)
    h = (u + 1) * g * jax.nn.sigmoid(1.702 * g)
    y = jnp.einsum("tem,emd->ted", h, arr(mlp.down, (Experts, Mlp, Embed)))
    y = y + arr(mlp.down_bias, (Experts, Embed))
    return jnp.einsum("ted,te->td", y, weights)


def routed(mlp: MoeMlp, x: jax.Array) -> jax.Array:
    return mlp(hax.named(x, ("tokens", Embed)))[0].array


def test_biased_clamped_experts_equal_the_dense_reference_values_and_gradients():
    mlp, x = layer(), jax.random.normal(jax.random.PRNGKey(2), (T, D))
    got, want = routed(mlp, x), dense(mlp, x)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    gate = jnp.einsum("td,edm->tem", x, mlp.gate.rearrange((Experts, Embed, Mlp)).array)
    assert float(jnp.max(gate + mlp.gate_bias.rearrange((Experts, Mlp)).array)) > 0.7  # clamped
    w = jax.random.normal(jax.random.PRNGKey(3), (T, D))
    ours = jax.jit(jax.grad(lambda m, x: jnp.sum(routed(m, x) * w), argnums=(0, 1)))(mlp, x)
    theirs = jax.jit(jax.grad(lambda m, x: jnp.sum(dense(m, x) * w), argnums=(0, 1)))(mlp, x)
    for name in ("router.weight", "router.bias", "gate", "up", "down", "gate_bias", "up_bias",
                 "down_bias"):  # fmt: skip
        a, b = attrgetter(name)(ours[0]).array, attrgetter(name)(theirs[0]).array
        assert float(jnp.max(jnp.abs(b))) > 1e-3, name
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(ours[1], theirs[1], atol=1e-4, rtol=1e-4)


def test_a_dropped_assignment_adds_no_down_bias():
    """Capacity 1 per expert drops most assignments: with zero weights and biases but the
    down bias, the output is the kept assignments' weighted down biases only."""
    moe = dataclasses.replace(MOE, capacity_factor=E / (T * K))  # one assignment an expert
    mlp = layer(moe)
    zero = lambda a: a * 0  # noqa: E731
    mlp = eqx.tree_at(
        lambda m: (m.gate, m.up, m.down), mlp, (zero(mlp.gate), zero(mlp.up), zero(mlp.down))
    )
    x = jax.random.normal(jax.random.PRNGKey(2), (T, D))
    out = routed(mlp, x)
    nonzero_rows = int(jnp.sum(jnp.any(out != 0, axis=-1)))
    assert 0 < nonzero_rows <= E  # the rows of the kept assignments, at most one an expert


@pytest.mark.parametrize("limit", [None, 0.7])
def test_gated_unit(limit):
    from loomax.models.blocks.mlp_activations import gated_unit

    g, u = jnp.asarray([-2.0, 0.5, 3.0]), jnp.asarray([-3.0, 0.2, 2.0])
    got = gated_unit("silu", limit)(g, u)
    if limit is None:
        want = jax.nn.silu(g) * u
    else:
        gc, uc = jnp.asarray([-2.0, 0.5, 0.7]), jnp.asarray([-0.7, 0.2, 0.7])
        want = (uc + 1) * gc * jax.nn.sigmoid(1.702 * gc)
    np.testing.assert_allclose(got, want, rtol=1e-6)
