"""Qwen3-MoE <-> ``Qwen3MoeForCausalLM``: Mixtral's tensors under Qwen's names, plus QK-norm.

Per layer: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm`` (over ``head_dim``),
the router ``mlp.gate.weight`` and each expert's ``mlp.experts.E.{gate,up,down}_proj.weight``
(Hub layout; transformers >= 5 fuses them on load). ``moe_intermediate_size`` is the
experts' width (``model.intermediate_dim``); ``norm_topk_prob`` travels both ways;
``router_aux_loss_coef`` is scaled by k as for Mixtral. Dense layers (``decoder_sparse_step``
above 1, ``mlp_only_layers``), sliding windows and attention biases are refused on import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf import llama as hf_llama
from loomax.hf import mixtral as hf_mixtral
from loomax.hf.layout import Param
from loomax.models.moe import MoeConfig
from loomax.models.qwen3_moe import Qwen3MoeConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
TRAINING_KEYS = ("attention_dropout", "router_aux_loss_coef")
"""config.json fields that are training settings, not architecture (a run may change them)."""


def params(config: Qwen3MoeConfig) -> list[Param]:
    blk = "model.layers.{i}."
    s = lambda m: m.blocks.stacked  # noqa: E731
    renamed = {
        "block_sparse_moe.gate.": "mlp.gate.",
        ".w1.": ".gate_proj.",
        ".w3.": ".up_proj.",
        ".w2.": ".down_proj.",
        "block_sparse_moe.experts.": "mlp.experts.",
    }
    out = []
    for p in hf_mixtral.params(config):
        name = p.hf_name
        for old, new in renamed.items():
            name = name.replace(old, new)
        out.append(Param(name, p.where, p.dims))
    return out + [
        Param(blk + "self_attn.q_norm.weight", lambda m: s(m).attn.q_norm.weight, ("head_size",)),
        Param(blk + "self_attn.k_norm.weight", lambda m: s(m).attn.k_norm.weight, ("head_size",)),
    ]


def hf_config(config: Qwen3MoeConfig, vocab_size: int) -> dict[str, Any]:
    if not config.qk_norm:
        raise ConfigError(f"{ARCHITECTURE} has QK-norm: export needs model.qk_norm: true")
    moe = config.moe
    # Mixtral's checks (softmax, no shared experts, dropless), QK-norm and norm_topk_prob aside
    unchecked = replace(config, qk_norm=False, moe=replace(moe, norm_topk_prob=True))
    checked = hf_mixtral.hf_config(unchecked, vocab_size)
    for key in ("num_local_experts", "router_jitter_noise", "sliding_window"):
        checked.pop(key)
    checked.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3_moe",
        num_experts=moe.num_experts,
        moe_intermediate_size=config.expert_dim,
        norm_topk_prob=moe.norm_topk_prob,
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    )
    return checked


def from_hf_config(hf: dict[str, Any]) -> Qwen3MoeConfig:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise BadFileError(
            "config.json: dense layers (decoder_sparse_step > 1 or mlp_only_layers) are not supported"
        )
    if hf.get("use_sliding_window"):
        raise BadFileError("config.json: use_sliding_window is not supported (full attention only)")
    if hf.get("attention_bias"):
        raise BadFileError("config.json: attention_bias is not supported by model.type qwen3_moe")
    llama = hf_llama.from_hf_config(
        {**hf, "intermediate_size": hf["moe_intermediate_size"], "mlp_bias": False}
    )
    k = hf.get("num_experts_per_tok", 8)
    moe = MoeConfig(
        num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
        num_experts_per_tok=k,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        load_balance_loss_weight=hf.get("router_aux_loss_coef", 0.001) * k,
    )
    fields = {f: getattr(llama, f) for f in llama.__dataclass_fields__}
    return Qwen3MoeConfig(**{**fields, "qk_norm": True}, moe=moe)
