"""Gemma 2 (``model.type: gemma2``) beyond the contract suites, and per-layer windows.

The suites over every family already check gemma2 at its defaults (training, save/load,
KV-cache decoding with its alternating windows, the numpy reference, transformers both
ways). Here: caps sharp enough to bend every score and logit still match transformers,
each switch changes the logits, the capped loss and its gradient equal the plain form,
per-layer windows run alike on the backends that skip blocks, and bad settings are refused.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, load_hf
from loomax.models import LlamaConfig, LmConfig, next_token_loss
from loomax.models.loss import capped_cross_entropy_sum, plain_cross_entropy_sum

VOCAB = 37
Gemma2 = LmConfig.get_choice_class("gemma2")
TINY = dict(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4,
            num_kv_heads=2, sliding_window=6)  # fmt: skip
SHARP = dict(attn_logit_softcapping=0.5, final_logit_softcapping=1.5, query_pre_attn_scalar=3)
IDS = hax.named(np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB)), "position")


def built(config, seed: int = 0):
    """Every weight random (norm scales too) and scaled up, the same for same-shaped configs."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [
        3 * x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def logits(config) -> np.ndarray:
    return np.asarray(built(config).logits(IDS).array)


def test_sharp_caps_and_query_scale_match_transformers(tmp_path):
    import torch
    import transformers

    model = built(Gemma2(**TINY, **SHARP))
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma2ForCausalLM"
    with torch.no_grad():
        want = hf(torch.tensor(np.asarray(IDS.array)[None], dtype=torch.long)).logits[0].numpy()
    got = np.asarray(model.logits(IDS).array)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() < 1.5  # the final cap bounds them


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_qwen_windows_from_max_window_layers_import_and_export(tmp_path, family):
    """Qwen's windows (layers from max_window_layers on) import with transformers' logits, and
    our export of them loads in transformers with ours."""
    import torch
    import transformers

    hf_config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
        use_sliding_window=True, sliding_window=3, max_window_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "theirs")
    model = load_hf(tmp_path / "theirs")
    assert model.config.layer_windows == (None, 3, 3)
    ids = torch.tensor(np.asarray(IDS.array)[None], dtype=torch.long)
    with torch.no_grad():
        want = hf(ids).logits[0].numpy()
    # each imported model's logits as one program (op by op, its ops compiled one by one)
    logits_of = eqx.filter_jit(lambda m: m.logits(IDS).array)
    np.testing.assert_allclose(logits_of(model), want, rtol=1e-5, atol=1e-5)
    full = dataclasses.replace(model.config, sliding_window=None, sliding_window_pattern=())
    build = lambda: full.build(VOCAB, key=jax.random.PRNGKey(0))  # noqa: E731
    skeleton = jax.tree.structure(eqx.filter_eval_shape(build))  # its structure only
    unwindowed = logits_of(jax.tree.unflatten(skeleton, jax.tree.leaves(model)))
    assert np.abs(unwindowed - want).max() > 1e-4  # the windows matter here
    export_hf(model, tmp_path / "ours", special_tokens={"eos_token_id": 0})
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert again.config.layer_types == hf.config.layer_types
    with torch.no_grad():
        np.testing.assert_allclose(again(ids).logits[0].numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=4),
        dict(sliding_window_pattern=(True,)),  # every layer sliding
        dict(sliding_window_pattern=(False, True)),  # the other layer
        dict(sliding_window=None, sliding_window_pattern=()),
    ],
)
def test_each_switch_changes_the_logits(change):
    base = logits(Gemma2(**TINY, **SHARP))
    assert np.abs(logits(Gemma2(**{**TINY, **SHARP, **change})) - base).max() > 1e-3


def test_the_window_pattern_repeats_over_the_layers():
    config = LlamaConfig(**{**TINY, "num_layers": 5}, sliding_window_pattern=[True, True, False])
    assert config.layer_windows == (6, 6, None, 6, 6)
    assert Gemma2(**TINY).layer_windows == (6, None)
    full, sliding = (LlamaConfig(**{**TINY, "sliding_window": w}) for w in (None, 6))
    mean = (full.attn_flops() + sliding.attn_flops()) / 2
    assert Gemma2(**TINY).attn_flops() == pytest.approx(mean)
    assert sliding.attn_flops() < mean < full.attn_flops()


def test_per_layer_windows_agree_on_the_backends_that_skip_blocks():
    mixed = dict(TINY, sliding_window=4, sliding_window_pattern=(False, True), seq_len=16)
    want = logits(LlamaConfig(**mixed, attn_backend="vanilla"))
    got = logits(LlamaConfig(**mixed, attn_backend="blockwise", flash_attention_block_size=4))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (
        np.abs(logits(LlamaConfig(**{**mixed, "sliding_window_pattern": ()})) - want).max() > 1e-3
    )


def test_capped_attention_and_its_gradient_agree_on_vanilla_and_blockwise():
    """Gemma 2 with sharp caps and alternating windows: blockwise (blocks of 4, its own
    gradient) equals vanilla (autodiff), logits and the loss's gradient."""
    configs = [Gemma2(**TINY, **SHARP, attn_backend=b, flash_attention_block_size=4)
               for b in ("vanilla", "blockwise")]  # fmt: skip
    models = [built(c) for c in configs]
    batch = hax.named(IDS.array[None], ("batch", "position"))

    def loss(m):
        total, count = next_token_loss(m, batch, block_size=8)
        return total / count

    # each as one compiled program (op by op, the blocks' own gradient compiles many)
    want, got = (np.asarray(eqx.filter_jit(lambda m: m.logits(IDS).array)(m)) for m in models)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    grads = [jax.tree.leaves(eqx.filter_jit(eqx.filter_grad(loss))(m)) for m in models]
    for g, w in zip(grads[1], grads[0], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_capped_loss_and_its_gradient_equal_the_plain_form():
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(kh, (12, 8))
    w = 2 * jax.random.normal(kw, (VOCAB, 8))
    t = jax.random.randint(kt, (12,), 0, VOCAB)
    m = jnp.ones(12).at[3].set(0.0)

    @jax.jit  # one program each (op by op, the blocked loss's gradient compiles many)
    def capped(h, w):
        return capped_cross_entropy_sum(h, w, t, m, 5, 1e-3, 2.0)  # 3 blocks, the last padded

    @jax.jit
    def plain(h, w):
        return plain_cross_entropy_sum(h, w, t, m, 1e-3, 2.0)

    np.testing.assert_allclose(capped(h, w), plain(h, w), rtol=1e-6)
    for got, want in zip(
        jax.jit(jax.grad(capped, (0, 1)))(h, w),
        jax.jit(jax.grad(plain, (0, 1)))(h, w),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert abs(plain(h, w) - plain_cross_entropy_sum(h, w, t, m, 1e-3)) > 1.0


def test_settings_without_a_cap_or_a_window_are_refused():
    with pytest.raises(ConfigError, match="model.attn_logit_softcapping needs"):
        Gemma2(**TINY, attn_backend="xla")
    Gemma2(**TINY, attn_backend="xla", attn_logit_softcapping=None)
    with pytest.raises(ConfigError, match="cross_entropy_vocab_block_size null"):
        Gemma2(**TINY, cross_entropy_vocab_block_size=8)
    with pytest.raises(ConfigError, match="sliding_window_pattern needs"):
        LlamaConfig(**{**TINY, "sliding_window": None}, sliding_window_pattern=(True, False))
    mistral = LmConfig.get_choice_class("mistral")(**TINY, sliding_window_pattern=(True, False))
    with pytest.raises(ConfigError, match=r"export needs model.sliding_window_pattern: \[\]"):
        mistral.hf_config(VOCAB)
    gemma = dataclasses.replace(Gemma2(**TINY), tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="tie_word_embeddings: true"):
        gemma.hf_config(VOCAB)
