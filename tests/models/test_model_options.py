"""Model options: ``scan_layers: false`` (unrolled: same logits, gradients and checkpoint
tree as the scan), ``flash_attention_block_size``, ``activation_function``, GPT-2's
``scale_attn_by_inverse_layer_idx`` and Llama's ``hybrid_norm``, ``input_embedding_norm``,
``use_bias`` and ``use_layer_norm_weight``. Parity with transformers: tests/hf."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import Gpt2Config, LlamaConfig, next_token_loss
from loomax.models.attention import attention
from loomax.tree_paths import named_leaves

VOCAB = 41
KEY = jax.random.PRNGKey(0)
GPT2 = Gpt2Config(seq_len=16, hidden_dim=16, num_layers=2, num_heads=2)
LLAMA = LlamaConfig(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2)
replace = dataclasses.replace


def tokens(seed: int = 1) -> hax.NamedArray:
    ids = jax.random.randint(jax.random.PRNGKey(seed), (2, 16), 0, VOCAB)
    return hax.named(ids, ("batch", "position"))


@eqx.filter_jit
def logits(model, key=None):
    return model.logits(tokens(), key=key).array


@eqx.filter_jit
def loss_grads(model, key=None):
    return eqx.filter_grad(lambda m: next_token_loss(m, tokens(), key=key)[0])(model)


def randomized(model, seed: int = 1):
    """Every weight moved off its initial value (norm scales and zero biases too)."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)


UNROLLED_CASES = {
    "gpt2-scaled-dropout-save-qkv": replace(
        GPT2, scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.2, attn_pdrop=0.2,
        remat_save=("qkv",),
    ),
    "llama-hybrid-no-remat": replace(LLAMA, hybrid_norm=True, gradient_checkpointing=False),
}  # fmt: skip


def with_config(model, config):
    """``model``'s weights in a model built by ``config`` (a layout-preserving option changed)."""
    skeleton = jax.eval_shape(lambda: config.build(VOCAB, key=KEY))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


@pytest.mark.parametrize("case", UNROLLED_CASES)
def test_unrolled_layers_equal_the_scan_with_the_same_checkpoint_tree(case):
    scanned = randomized(UNROLLED_CASES[case].build(VOCAB, key=KEY))
    config = replace(UNROLLED_CASES[case], scan_layers=False)
    fresh = config.build(VOCAB, key=KEY)
    layout = lambda m: [(n, x.axes) for n, x in named_leaves(m)]  # noqa: E731
    assert layout(fresh) == layout(scanned)  # stacked either way: a checkpoint fits both
    unrolled = with_config(scanned, config)
    key = jax.random.PRNGKey(7)  # per-layer dropout keys are the same either way
    np.testing.assert_allclose(logits(unrolled, key), logits(scanned, key), rtol=1e-5, atol=1e-5)
    want, got = loss_grads(scanned, key), loss_grads(unrolled, key)
    # the scan and the unrolled stack sum the same float32 terms in a different order: an
    # element that is a near-cancellation of large terms differs by a few ulps of those terms,
    # not of itself (an AMD EPYC's matmul library missed rtol 1e-4 on one such element): the
    # absolute tolerance follows the leaf's own scale
    for (name, a), (_, b) in zip(named_leaves(want), named_leaves(got), strict=True):
        scale = float(np.max(np.abs(a.array)))
        np.testing.assert_allclose(b.array, a.array, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_unrolled_layers_refuse_scan_options():
    with pytest.raises(ConfigError, match="model.scan_unroll"):
        replace(GPT2, scan_layers=False, scan_unroll=2)
    with pytest.raises(ConfigError, match="model.gradient_checkpointing nested"):
        replace(LLAMA, scan_layers=False, gradient_checkpointing="nested")


def test_flash_attention_block_size_is_the_blockwise_block(monkeypatch):
    blocks = []
    real = attention.flash_attention
    monkeypatch.setattr(
        attention, "flash_attention", lambda *args: blocks.append(args[5]) or real(*args)
    )
    config = replace(LLAMA, attn_backend="blockwise", flash_attention_block_size=8)
    model = config.build(VOCAB, key=KEY)
    got = logits(model)
    assert set(blocks) == {8}
    vanilla = with_config(model, replace(config, attn_backend="vanilla"))
    np.testing.assert_allclose(got, logits(vanilla), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="model.flash_attention_block_size"):
        replace(LLAMA, flash_attention_block_size=0)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_activation_function_is_the_mlp_nonlinearity(config):
    model = randomized(config.build(VOCAB, key=KEY))
    relu = with_config(model, replace(config, activation_function="relu"))
    assert not np.allclose(logits(relu), logits(model), atol=1e-4)
    with pytest.raises(ConfigError, match="model.activation_function"):
        replace(config, activation_function="gelu_newer")


def test_scale_attn_by_inverse_layer_idx_changes_the_model():
    model = randomized(GPT2.build(VOCAB, key=KEY))
    scaled = with_config(model, replace(GPT2, scale_attn_by_inverse_layer_idx=True))
    assert not np.allclose(logits(scaled), logits(model), atol=1e-4)


def _biases(m):
    a, f = m.blocks.stacked.attn, m.blocks.stacked.mlp
    projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj)
    return tuple(p.bias for p in projections)


ADDED = {  # option: (its new parameters, how many)
    "hybrid_norm": (lambda m: (m.blocks.stacked.attn_out_norm, m.blocks.stacked.mlp_out_norm), 64),
    "input_embedding_norm": (lambda m: m.embed_norm, 16),
    "use_bias": (_biases, 2 * (4 * 16 + 2 * 32 + 16)),
}


@pytest.mark.parametrize("option", ADDED)
def test_llama_options_add_parameters_that_act_and_learn(option):
    where, count = ADDED[option]
    config = replace(LLAMA, **{option: True})
    assert config.param_count(VOCAB) - LLAMA.param_count(VOCAB) == count
    fresh = config.build(VOCAB, key=KEY)
    plain = LLAMA.build(VOCAB, key=KEY)
    same_at_init = option == "use_bias"  # zero biases; fresh norms still normalise
    assert np.allclose(logits(fresh), logits(plain), atol=1e-6) == same_at_init
    model = randomized(fresh)
    nudged = eqx.tree_at(where, model, replace_fn=lambda t: jax.tree.map(lambda x: x + 0.5, t))
    assert not np.allclose(logits(nudged), logits(model), atol=1e-4)
    for grad in jax.tree.leaves(where(loss_grads(model))):
        assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0


def test_llama_weightless_norms_are_unit_scales():
    plain = replace(LLAMA, qk_norm=True)
    config = replace(plain, use_layer_norm_weight=False)
    per_layer = 2 * 16 + 2 * 8  # input and post-attention norms, QK-norms over head_size
    assert plain.param_count(VOCAB) - config.param_count(VOCAB) == 2 * per_layer + 16
    model, scaled = config.build(VOCAB, key=KEY), plain.build(VOCAB, key=KEY)  # scales of 1
    assert not any("norm" in name for name, _ in named_leaves(model))
    np.testing.assert_allclose(logits(model), logits(scaled), rtol=1e-6, atol=1e-6)
    scaled = eqx.tree_at(lambda m: m.norm.weight, scaled, replace_fn=lambda w: w * 2)
    assert not np.allclose(logits(model), logits(scaled), atol=1e-4)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(loss_grads(randomized(model))))
