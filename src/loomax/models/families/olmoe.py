"""OLMoE: the Mixtral model with OLMoE's QK-norm over the whole projection and its routing.

``model.type: olmoe`` builds the same ``MixtralLmModel``; what differs is configuration:
RMSNorm over the whole query and key projections, all heads together, before rotary
(``qk_norm`` with the ``projection`` QK-norm scope, as OLMo 2), and the router's top-k
weights used as the softmax gave them (``moe.norm_topk_prob: false``).

Its HF side (``OlmoeForCausalLM``): Qwen3-MoE's tensor names, with ``self_attn.{q,k}_norm``
of ``num_heads * head_dim`` and ``num_kv_heads * head_dim`` entries. ``norm_topk_prob``
travels both ways, ``router_aux_loss_coef`` is scaled by k as for Mixtral; ``clip_qkv`` and
attention biases are refused on import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.families.mixtral import MixtralConfig
from loomax.models.families.qwen3_moe import Qwen3MoeConfig
from loomax.models.moe.moe import MoeConfig


def _olmoe() -> MoeConfig:
    return MoeConfig(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False)


@LmConfig.register_subclass("olmoe")
@dataclass(frozen=True)
class OlmoeConfig(MixtralConfig):
    """OLMoE decoder (Muennighoff et al. 2024): Mixtral's layout with whole-projection QK-norm."""

    qk_norm: bool = True
    """RMSNorm over the whole query and key projections before rotary (OLMoE: true)."""
    moe: MoeConfig = field(default_factory=_olmoe)
    """Experts, routing, balance losses and the grouped matmul (the `moe` section; OLMoE: 64 experts, top 8, weights not renormalised)."""

    qk_norm_scope: ClassVar[str] = "projection"
    hf_model_type: ClassVar[str | None] = "olmoe"
    hf_architecture: ClassVar[str] = "OlmoeForCausalLM"
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **Qwen3MoeConfig.hf_requires,
        "qk_norm": (True, "has QK-norm over the whole projection"),
    }
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **MixtralConfig.hf_field_names,  # num_local_experts: transformers 5 saves that name
        "num_experts": "moe.num_experts", "norm_topk_prob": "moe.norm_topk_prob",
        "clip_qkv": None,
    }  # fmt: skip
    hf_moe_requires: ClassVar[dict[str, tuple[Any, str]]] = Qwen3MoeConfig.hf_moe_requires
    hf_expert_names: ClassVar[tuple[str, str, str, str]] = Qwen3MoeConfig.hf_expert_names

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        for key in ("num_local_experts", "router_jitter_noise", "sliding_window"):
            del out[key]
        return {
            **out,
            "num_experts": self.moe.num_experts,
            "norm_topk_prob": self.moe.norm_topk_prob,
            "attention_bias": False,
            "clip_qkv": None,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> OlmoeConfig:
        if hf.get("clip_qkv") is not None:
            raise BadFileError(f"config.json: clip_qkv {hf['clip_qkv']} is not supported")
        if hf.get("attention_bias"):
            raise BadFileError("config.json: attention_bias is not supported by model.type olmoe")
        return cls(moe=cls._hf_moe(hf, 64, 8, 0.01), **cls._hf_fields(hf))
