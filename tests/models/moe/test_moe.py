"""The mixture-of-experts MLP: one expert with k=1 is the dense MLP; the layer equals a
per-token float64 reference (dropless and with a capacity), with every grouped-matmul form
and the same gradients; routing variants; the balance losses' normalisation; its FLOPs
scale with k, not with the number of experts."""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis

from loomax.config import ConfigError
from loomax.models.families.llama import LlamaConfig, LlamaMlp
from loomax.models.moe.moe import MoeConfig, MoeMlp
from loomax.models.moe.moe_routing import RouterAux, load_balance_loss, route, router_z_loss

EMBED = Axis("embed", 16)
WIDTH = 24
X = hax.random.normal(jax.random.PRNGKey(1), (Axis("batch", 3), Axis("position", 7), EMBED))


def layer(seed=0, **moe) -> MoeMlp:
    config = MoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2, "matmul_block": 4, **moe})
    return MoeMlp.init(config, EMBED, WIDTH, "silu", 1.0, key=jax.random.PRNGKey(seed))


def with_moe(mlp: MoeMlp, **changes) -> MoeMlp:
    return dataclasses.replace(mlp, moe=dataclasses.replace(mlp.moe, **changes))


def reference(mlp: MoeMlp, x) -> tuple[np.ndarray, int]:
    """Token by token in float64: softmax router, top k, renormalised, the k experts' gated
    MLPs summed; with a capacity, assignments past it (in token order) dropped."""
    t = np.asarray(x.array, np.float64).reshape(-1, EMBED.size)
    r = np.asarray(mlp.router.weight.rearrange(("experts", "embed")).array, np.float64)
    g, u, d = (
        np.asarray(a.rearrange(axes).array, np.float64)
        for a, axes in (
            (mlp.gate, ("experts", "embed", "mlp")),
            (mlp.up, ("experts", "embed", "mlp")),
            (mlp.down, ("experts", "mlp", "embed")),
        )
    )
    logits = t @ r.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k, E = mlp.moe.num_experts_per_tok, mlp.moe.num_experts
    capacity = mlp.moe.capacity(len(t))
    taken, dropped = np.zeros(E, int), 0
    out = np.zeros_like(t)
    for i, row in enumerate(t):
        top = np.argsort(-probs[i], kind="stable")[:k]
        w = probs[i, top] / probs[i, top].sum()
        for e, weight in zip(top, w, strict=True):
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            h = row @ g[e]
            out[i] += weight * ((h / (1 + np.exp(-h))) * (row @ u[e])) @ d[e]
    return out.reshape(x.array.shape), dropped


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_layer_equals_the_per_token_reference(impl, capacity_factor):
    mlp = with_moe(layer(), matmul=impl, capacity_factor=capacity_factor)
    out, aux = jax.jit(lambda m, x: m(x, RouterAux.zeros(1, 4), 0))(mlp, X)
    want, dropped = reference(mlp, X)
    assert out.axes == X.axes
    np.testing.assert_allclose(out.array, want, rtol=1e-6, atol=1e-6)
    if capacity_factor is not None:
        assert dropped > 0  # the case drops something, and the metric counts it
    np.testing.assert_allclose(aux.dropped[0], dropped / (X.array.size // EMBED.size * 2))


def test_gradients_equal_across_grouped_matmuls():
    mlp = layer()

    def grads(impl):
        def loss(m, x):
            out, aux = m(x, RouterAux.zeros(1, 4), 0)
            return jnp.sum(out.array**2) + aux.balance[0] + aux.z[0]

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(with_moe(mlp, matmul=impl), X)

    blocked, ragged = grads("blocked"), grads("ragged_dot")
    for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(ragged), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    router = blocked[0].router.weight.array
    assert np.abs(router).max() > 0  # the router learns (through weights and balance losses)


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
def test_one_expert_with_k1_is_the_dense_mlp(impl):
    dense_config = LlamaConfig(
        hidden_dim=EMBED.size, intermediate_dim=WIDTH, num_layers=1, num_heads=4
    )
    dense = LlamaMlp.init(dense_config, key=jax.random.PRNGKey(4))
    moe = with_moe(layer(num_experts=1, num_experts_per_tok=1), matmul=impl)
    expert = lambda lin: lin.weight.broadcast_axis(Axis("experts", 1))  # noqa: E731
    moe = dataclasses.replace(
        moe, gate=expert(dense.gate_proj), up=expert(dense.up_proj), down=expert(dense.down_proj)
    )
    out, _ = jax.jit(lambda m, x: m(x))(moe, X)
    want = jax.jit(lambda m, x: m(x))(dense, X)
    np.testing.assert_allclose(out.array, want.rearrange(out.axes).array, rtol=1e-6, atol=1e-6)


def test_shared_experts_add_a_dense_gated_mlp():
    mlp = layer(num_shared_experts=2)
    assert mlp.shared_gate.Out.size == 2 * WIDTH
    unshared = dataclasses.replace(mlp, shared_gate=None, shared_up=None, shared_down=None)

    @jax.jit
    def both(mlp, unshared, x):
        shared = mlp.shared_down(hax.nn.silu(mlp.shared_gate(x)) * mlp.shared_up(x))
        return mlp(x)[0], unshared(x)[0] + shared

    out, want = both(mlp, unshared, X)
    np.testing.assert_allclose(out.array, want.rearrange(out.axes).array, rtol=1e-6, atol=1e-6)


def test_routing_variants():
    logits = jax.random.normal(jax.random.PRNGKey(2), (6, 5))
    w, e, p = route(logits, 2)
    np.testing.assert_allclose(jnp.sum(w, -1), 1, rtol=1e-6)
    np.testing.assert_allclose(p, jax.nn.softmax(logits), rtol=1e-6)
    raw, e_raw, _ = route(logits, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(e, e_raw)
    np.testing.assert_allclose(raw, jnp.take_along_axis(p, e, -1), rtol=1e-6)
    sig, e_sig, p_sig = route(logits, 2, score="sigmoid", norm_topk_prob=False)
    np.testing.assert_allclose(sig, jnp.take_along_axis(jax.nn.sigmoid(logits), e_sig, -1))
    np.testing.assert_allclose(jnp.sum(p_sig, -1), 1, rtol=1e-6)
    bias = jnp.zeros(5).at[0].set(10.0)  # the bias picks expert 0 for every token ...
    wb, eb, _ = route(logits, 1, norm_topk_prob=False, bias=bias)
    np.testing.assert_array_equal(eb[:, 0], 0)
    np.testing.assert_allclose(wb[:, 0], p[:, 0], rtol=1e-6)  # ... but weighs it unbiased


@pytest.mark.parametrize("k", [1, 2])
def test_load_balance_loss_is_one_at_perfect_balance_for_any_k(k):
    E, T = 4, 8
    uniform = jnp.full((T, E), 1 / E)
    assert float(load_balance_loss(jnp.full((E,), T * k // E), uniform)) == pytest.approx(1.0)
    collapsed = jax.nn.one_hot(jnp.zeros(T, int), E)  # every token (and its mass) to expert 0
    sizes = jnp.zeros(E).at[0].set(T * k)
    assert float(load_balance_loss(sizes, collapsed)) == pytest.approx(E)


def test_router_z_loss_and_metrics():
    logits = jax.random.normal(jax.random.PRNGKey(5), (10, 4))
    want = np.mean(np.log(np.sum(np.exp(np.asarray(logits, np.float64)), -1)) ** 2)
    assert float(router_z_loss(logits)) == pytest.approx(want, rel=1e-6)
    sizes = jnp.array([8, 4, 4, 4])
    aux = RouterAux.zeros(2, 4).record(1, logits, jax.nn.softmax(logits), sizes, jnp.array(2))
    m = aux.metrics()
    assert m["moe/layer_1/load_max"] == pytest.approx(8 * 4 / 20)
    assert m["moe/layer_1/load_min"] == pytest.approx(4 * 4 / 20)
    assert m["moe/layer_1/dropped_fraction"] == pytest.approx(0.1)
    assert m["moe/layer_0/load_max"] == 0  # layer 0 not recorded
    assert m["moe/router_z_loss"] == pytest.approx(want / 2, rel=1e-6)  # mean over 2 layers
    assert set(aux.losses(0.01, 0.0)) == {"load_balance"}


def _flops(mlp) -> float:
    x = hax.random.normal(jax.random.PRNGKey(1), (Axis("position", 256), EMBED))
    return jax.jit(lambda m, x: m(x)[0]).lower(mlp, x).compile().cost_analysis()["flops"]


def test_flops_scale_with_k_not_with_the_number_of_experts():
    base = _flops(layer(num_experts=4, num_experts_per_tok=2))
    many = _flops(layer(num_experts=32, num_experts_per_tok=2))
    double_k = _flops(layer(num_experts=4, num_experts_per_tok=4))
    assert many < 1.6 * base  # 8x the experts: the padding of the extra groups, not 8x
    assert 1.7 * base < double_k < 2.3 * base


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"score_function": "relu"}, "score_function"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"matmul": "dense"}, "model.moe.matmul"),
        ({"load_balance_loss_weight": -1.0}, "load_balance_loss_weight"),
    ],
)
def test_bad_settings_are_config_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        MoeConfig(num_experts=4, **changes)
