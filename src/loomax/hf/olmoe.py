"""OLMoE <-> ``OlmoeForCausalLM``: Qwen3-MoE's tensor names, QK-norm over the whole projection.

Per layer: ``self_attn.{q,k}_norm.weight`` of ``num_heads * head_dim`` and
``num_kv_heads * head_dim`` entries, the router ``mlp.gate.weight`` and each expert's
``mlp.experts.E.{gate,up,down}_proj.weight``. ``norm_topk_prob`` travels both ways,
``router_aux_loss_coef`` is scaled by k as for Mixtral; ``clip_qkv`` and attention biases
are refused on import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf import llama as hf_llama
from loomax.hf import mixtral as hf_mixtral
from loomax.hf import qwen3_moe as hf_qwen3_moe
from loomax.hf.layout import Param
from loomax.models.moe import MoeConfig
from loomax.models.olmoe import OlmoeConfig

ARCHITECTURE = "OlmoeForCausalLM"
TRAINING_KEYS = ("attention_dropout", "router_aux_loss_coef")
"""config.json fields that are training settings, not architecture (a run may change them)."""


def params(config: OlmoeConfig) -> list[Param]:
    s = lambda m: m.blocks.stacked  # noqa: E731
    blk = "model.layers.{i}.self_attn."
    out = [p for p in hf_qwen3_moe.params(config) if "_norm." not in p.hf_name]
    q, kv = ("heads", "head_size"), ("kv_heads", "head_size")
    return out + [
        Param(blk + "q_norm.weight", lambda m: s(m).attn.q_norm.weight, (q,)),
        Param(blk + "k_norm.weight", lambda m: s(m).attn.k_norm.weight, (kv,)),
    ]


def hf_config(config: OlmoeConfig, vocab_size: int) -> dict[str, Any]:
    if not (config.qk_norm and config.qk_norm_over_heads):
        raise ConfigError(
            f"{ARCHITECTURE} has QK-norm over the whole projection: export needs model.qk_norm: "
            "true and model.qk_norm_over_heads: true"
        )
    moe = config.moe
    unchecked = replace(
        config, qk_norm=False, qk_norm_over_heads=False, moe=replace(moe, norm_topk_prob=True)
    )
    out = hf_mixtral.hf_config(unchecked, vocab_size)  # softmax, no shared experts, dropless
    for key in ("num_local_experts", "router_jitter_noise", "sliding_window"):
        out.pop(key)
    out.update(
        architectures=[ARCHITECTURE],
        model_type="olmoe",
        num_experts=moe.num_experts,
        norm_topk_prob=moe.norm_topk_prob,
        attention_bias=False,
        clip_qkv=None,
    )
    return out


def from_hf_config(hf: dict[str, Any]) -> OlmoeConfig:
    if hf.get("clip_qkv") is not None:
        raise BadFileError(f"config.json: clip_qkv {hf['clip_qkv']} is not supported")
    if hf.get("attention_bias"):
        raise BadFileError("config.json: attention_bias is not supported by model.type olmoe")
    llama = hf_llama.from_hf_config({**hf, "mlp_bias": False})
    k = hf.get("num_experts_per_tok", 8)
    moe = MoeConfig(
        num_experts=hf.get("num_experts", hf.get("num_local_experts", 64)),
        num_experts_per_tok=k,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        load_balance_loss_weight=hf.get("router_aux_loss_coef", 0.01) * k,
    )
    fields = {f: getattr(llama, f) for f in llama.__dataclass_fields__}
    return OlmoeConfig(**{**fields, "qk_norm": True, "qk_norm_over_heads": True}, moe=moe)
