"""Qwen3.5-MoE's text model (``model.type: qwen3_5_moe_text``): a model transformers built
(random weights, a linear and a full layer) imports with its logits (f32, 1e-5) and greedy
tokens and exports back tensor for tensor (the DeltaNet's four projections regrouped into
Qwen3-Next's fused layout and out again); a router that does not renormalise is refused.
The export direction (logits, greedy tokens) is tests/hf/test_transformers.py's round trip
over every family; training, decoding, packing, remat and the refusals are Qwen3-Next's
model (test_qwen3_next.py: trained 12 steps, exported, transformers' greedy tokens)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, load_hf
from loomax.models import LmConfig
from loomax.models.decoding.generate import sample_tokens
from loomax.models.moe.moe import MoeConfig

VOCAB = 37
KEY = jax.random.PRNGKey(0)
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))
PROMPT = [3, 1, 4, 1, 5]
Qwen35Moe = LmConfig.get_choice_class("qwen3_5_moe_text")
TINY = Qwen35Moe(
    seq_len=16, hidden_dim=16, num_layers=2, layer_types=("linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=8, linear_key_heads=2, linear_value_heads=4,
    linear_key_dim=8, linear_value_dim=8, linear_chunk=4, expert_dim=16, shared_expert_dim=24,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
)  # fmt: skip
FOUR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def tensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(path / "model.safetensors")


def test_a_model_transformers_built_imports_with_its_logits_tokens_and_tensors(tmp_path, families):
    import transformers

    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=16,
    )  # fmt: skip
    hf = families.noisy_hf_model(config, 0.5)
    hf.save_pretrained(tmp_path / "theirs")
    loaded = load_hf(tmp_path / "theirs")
    assert type(loaded.config) is Qwen35Moe and loaded.config.rotary_dim == 2
    np.testing.assert_allclose(
        families.jit_logits(loaded, IDS), families.hf_logits(hf, IDS), rtol=1e-5, atol=1e-5
    )
    ours = sample_tokens(loaded, PROMPT, seq_len=16, max_new_tokens=8, temperature=0.0, key=KEY)
    assert ours == families.hf_greedy(hf, PROMPT, 8)
    export_hf(loaded, tmp_path / "back")
    theirs, back = tensors(tmp_path / "theirs"), tensors(tmp_path / "back")
    assert sorted(back) == sorted(theirs)
    assert all(f"model.layers.0.linear_attn.{n}.weight" in back for n in FOUR)
    for name, array in theirs.items():
        np.testing.assert_array_equal(back[name], array, err_msg=name)


def test_a_router_that_does_not_renormalise_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.moe.norm_topk_prob"):
        dataclasses.replace(TINY, moe=MoeConfig(num_experts=4, norm_topk_prob=False))
