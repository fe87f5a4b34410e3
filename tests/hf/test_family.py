"""Families by config.json model type: Kimi K2's checkpoints (``kimi_k2``) read as deepseek_v3."""

from __future__ import annotations

from loomax.hf.family import family_for
from loomax.models.attention.rotary import YarnRotary
from loomax.models.families.deepseek_v3 import DeepseekV3Config

KIMI_K2 = {  # Kimi-K2-Instruct's config.json fields, sizes shrunk (its own: 7168 wide, 61 layers)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 12, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0, "attention_bias": False,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}  # fmt: skip


def test_kimi_k2_reads_as_deepseek_v3_with_its_sizes():
    family = family_for(KIMI_K2)
    assert family is DeepseekV3Config
    config = family.from_hf_config(KIMI_K2)
    assert (config.num_heads, config.moe.num_experts, config.moe.num_groups) == (4, 12, 1)
    assert (config.moe.topk_groups, config.moe.first_dense_layers, config.mtp_depth) == (1, 1, 0)
    assert config.moe.routed_scaling_factor == 2.827
    assert isinstance(config.rope, YarnRotary) and config.rope.theta == 50000.0
    assert (config.rope.factor, config.rope.beta_fast) == (32.0, 1.0)
