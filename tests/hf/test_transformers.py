"""Against transformers itself (torch CPU, both in the `test` extra): exports load with the
same logits, for GPT-2 (also with another activation and scale_attn_by_inverse_layer_idx),
Llama with GQA/MQA, every rope variant (default, linear, llama3, YaRN) and biases, Mixtral
(per-expert tensors, softmax top-2 router) and Qwen3-MoE (QK-norm, norm_topk_prob) at 1e-5, and models
saved by transformers import with them; every activation_function is transformers' own. Nothing comes from the Hub: each
model is built from a config here and saved to a tmp dir (conftest sets HF_HUB_OFFLINE)."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.hf import export_hf, load_hf
from loomax.models import Gpt2Config, LlamaConfig, MixtralConfig, MoeConfig, Qwen3MoeConfig
from loomax.models.mlp_activations import ACTIVATION_FUNCTIONS
from loomax.models.rotary import LinearRotary, YarnRotary

from .test_convert import CASES, VOCAB, randomized

ALL = {
    **CASES,
    "llama-mqa-yarn": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=1, rope=YarnRotary(factor=4.0, original_max_position_embeddings=8),
    ),
    "llama-linear": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        rope=LinearRotary(factor=2.0),
    ),
    "gpt2-gelu-layer-scaled": Gpt2Config(
        seq_len=32, hidden_dim=32, num_layers=2, num_heads=4, activation_function="gelu",
        scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.1, attn_pdrop=0.1, embed_pdrop=0.1,
    ),
    "llama-bias-gelu": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, use_bias=True, activation_function="gelu_new", attn_pdrop=0.1,
    ),
    "mixtral": MixtralConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4,
        num_kv_heads=2, moe=MoeConfig(num_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": Qwen3MoeConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=24, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16,
        moe=MoeConfig(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    ),
}  # fmt: skip
TOLERANCE = {
    "gpt2-gelu-layer-scaled": 1e-5, "llama-bias-gelu": 1e-5, "mixtral": 1e-5, "qwen3_moe": 1e-5,
}  # fmt: skip
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}  # fmt: skip
"""Cases compared at 1e-5 (f32); the older cases keep 1e-4."""


@pytest.fixture(scope="module")
def torch():
    """torch, imported where it is used: at collection it would cost every xdist worker ~7 s."""
    import torch

    return torch


@pytest.fixture(scope="module")
def transformers(torch):
    import transformers

    return transformers


@pytest.mark.parametrize("case", ALL)
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, case, torch, transformers):
    model = randomized(ALL[case])
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHITECTURES[case.split("-")[0]]
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = np.asarray(model.logits(hax.named(ids, "position")).array)
    tol = TOLERANCE.get(case, 1e-4)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_activation_functions_are_transformers(torch, transformers):
    from transformers.activations import ACT2FN

    x = np.linspace(-5, 5, 201, dtype=np.float32)
    for name, fn in ACTIVATION_FUNCTIONS.items():
        want = ACT2FN[name](torch.tensor(x)).numpy()
        got = np.asarray(fn(hax.named(x, "mlp")).array)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


HF_CONFIGS = {
    "gpt2": lambda transformers: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
    ),
    "llama-gqa": lambda transformers: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    ),
    "gpt2-relu-layer-scaled": lambda transformers: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        activation_function="relu", scale_attn_by_inverse_layer_idx=True,
    ),
    "llama-bias-relu2": lambda transformers: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_bias=True, mlp_bias=True, hidden_act="relu2",
    ),
    "mixtral": lambda transformers: transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen3_moe": lambda transformers: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    ),
}  # fmt: skip

ROPE_PARAMETERS = {
    "llama-theta": {"rope_type": "default", "rope_theta": 500000.0},
    "llama-linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama-llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0,
    },
    "llama-yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    },
}  # fmt: skip
"""transformers 5 saves these as `rope_parameters` (no top-level rope_theta/rope_scaling)."""


def _llama_with_rope(transformers, case: str):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rope_parameters=dict(ROPE_PARAMETERS[case]),
    )  # fmt: skip


for _case in ROPE_PARAMETERS:
    HF_CONFIGS[_case] = lambda transformers, case=_case: _llama_with_rope(transformers, case)


@pytest.mark.parametrize("case", HF_CONFIGS)
def test_a_model_saved_by_transformers_imports_with_the_same_logits(
    tmp_path, case, torch, transformers
):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[case](transformers)).eval()
    with torch.no_grad():  # move every weight off its initial value (norm scales too)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = np.asarray(model.logits(hax.named(ids, "position")).array)
    exact = ("gpt2-relu-layer-scaled", "llama-bias-relu2", "mixtral", "qwen3_moe")
    tol = 1e-5 if case in exact else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
