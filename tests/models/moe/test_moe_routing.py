"""DeepSeek-V3 routing (sigmoid scores, the correction bias for the choice only, group-limited
top-k, routed_scaling_factor, normalised top-k weights, shared experts) equals transformers'
``DeepseekV3MoE`` on random inputs (f32, 1e-5), with and without renormalisation; the bias
and the groups each change the choice (so the test would see either missing); bad group
settings are refused naming the key."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import MoeConfig
from loomax.models.moe.moe import MoeMlp
from loomax.models.moe.moe_routing import route

D, W, E, T = 16, 8, 8, 24
MOE = MoeConfig(
    num_experts=E, num_experts_per_tok=3, expert_intermediate_dim=W, score_function="sigmoid",
    num_shared_experts=1, num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
    routing_bias=True, matmul="blocked", matmul_block=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def torch_moe(torch, norm_topk_prob: bool):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=W, n_routed_experts=E, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    torch.manual_seed(0)
    moe = DeepseekV3MoE(config).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        # a bias of the scores' size: it changes which experts are chosen
        moe.gate.e_score_correction_bias.copy_(0.3 * torch.randn(E))
    return moe


def loomax_moe(torch_module, moe: MoeConfig) -> MoeMlp:
    """A ``MoeMlp`` holding ``torch_module``'s weights."""
    t = {k: v.detach().numpy() for k, v in torch_module.state_dict().items()}
    m = MoeMlp.init(moe, hax.Axis("embed", D), W, "silu", 1.0, key=jax.random.PRNGKey(0))
    named = lambda a, axes: hax.named(jax.numpy.asarray(a), axes)  # noqa: E731
    gate_up = t["experts.gate_up_proj"]  # [E, 2I, D]
    updates = {
        "router.weight": named(t["gate.weight"], ("experts", "embed")),
        "gate": named(gate_up[:, :W], ("experts", "mlp", "embed")),
        "up": named(gate_up[:, W:], ("experts", "mlp", "embed")),
        "down": named(t["experts.down_proj"], ("experts", "embed", "mlp")),
        "shared_gate.weight": named(t["shared_experts.gate_proj.weight"], ("mlp", "embed")),
        "shared_up.weight": named(t["shared_experts.up_proj.weight"], ("mlp", "embed")),
        "shared_down.weight": named(t["shared_experts.down_proj.weight"], ("embed", "mlp")),
        "bias.value": named(t["gate.e_score_correction_bias"], ("experts",)),
    }
    for path, value in updates.items():

        def where(module, path=path):
            for part in path.split("."):
                module = getattr(module, part)
            return module

        value = value.rearrange(where(m).axes)
        m = eqx.tree_at(where, m, value)
    return m


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equals_transformers_deepseek_v3_moe(torch, norm_topk_prob):
    hf = torch_moe(torch, norm_topk_prob)
    moe = dataclasses.replace(MOE, norm_topk_prob=norm_topk_prob)
    ours = loomax_moe(hf, moe)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (2, T // 2, D)))
    with torch.no_grad():
        want = hf(torch.tensor(x)).numpy()
        _, want_w, want_e = hf.gate(torch.tensor(x))
    got, _ = jax.jit(lambda m, x: m(x))(ours, hax.named(x, ("batch", "position", "embed")))
    np.testing.assert_allclose(got.array, want, rtol=1e-5, atol=1e-5)
    # the same experts and weights per token (both sorted by expert)
    logits = (
        x.reshape(-1, D) @ np.asarray(ours.router.weight.rearrange(("experts", "embed")).array).T
    )
    bias = ours.bias.value.array
    w, e, _ = route(logits, 3, score="sigmoid", norm_topk_prob=norm_topk_prob, bias=bias,
                    groups=4, topk_groups=2, scale=2.5)  # fmt: skip
    order, want_order = np.argsort(e, -1), np.argsort(want_e.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1),
                                  np.take_along_axis(want_e.numpy(), want_order, -1))  # fmt: skip
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(want_w.numpy(), want_order, -1), rtol=1e-5)  # fmt: skip
    # the bias and the group limit each change the choice here
    plain = route(logits, 3, score="sigmoid", groups=4, topk_groups=2)[1]
    ungrouped = route(logits, 3, score="sigmoid", bias=bias)[1]
    for other in (plain, ungrouped):
        assert not np.array_equal(np.sort(other, -1), np.sort(np.asarray(e), -1))


def test_the_bias_never_reaches_the_weights():
    logits = jax.random.normal(jax.random.PRNGKey(2), (T, E))
    bias = jax.numpy.zeros(E).at[0].set(10.0)  # expert 0 always chosen, its weight its score
    w, e, _ = route(logits, 2, score="sigmoid", norm_topk_prob=False, bias=bias, groups=4,
                    topk_groups=2, scale=2.0)  # fmt: skip
    assert np.all(np.asarray(e)[:, 0] == 0)
    np.testing.assert_allclose(w[:, 0], 2.0 * jax.nn.sigmoid(logits[:, 0]), rtol=1e-6)


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(num_groups=3), "num_groups"),
        (dict(num_groups=4, topk_groups=5), "topk_groups"),
        (dict(num_groups=8, topk_groups=1), "topk_groups"),  # 1 expert a group < k = 3
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ],
)
def test_bad_group_settings_are_refused_naming_the_key(fields, key):
    base = dict(num_experts=E, num_experts_per_tok=3)
    with pytest.raises(ConfigError, match=f"model.moe.{key}"):
        MoeConfig(**base, **fields)
