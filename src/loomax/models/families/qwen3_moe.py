"""Qwen3-MoE: the Mixtral model with Qwen 3's per-head QK-norm and its routing defaults.

``model.type: qwen3_moe`` builds the same ``MixtralLmModel`` (Llama attention and blocks,
mixture-of-experts MLPs); what differs is configuration: RMSNorm over ``head_size`` on
queries and keys before rotary (``qk_norm``), epsilon 1e-6, and the router's top-k weights
used as they are (``moe.norm_topk_prob: false``, transformers' default; checkpoints may
set it).

Its HF side (``Qwen3MoeForCausalLM``): Mixtral's tensors under Qwen's names, per layer
``self_attn.{q,k}_norm`` (over ``head_dim``), the router ``mlp.gate.weight`` and each
expert's ``mlp.experts.E.{gate,up,down}_proj.weight`` (Hub layout). ``moe_intermediate_size``
is the experts' width (``model.intermediate_dim``); ``norm_topk_prob`` travels both ways;
``router_aux_loss_coef`` is scaled by k as for Mixtral. Dense layers (``decoder_sparse_step``
above 1, ``mlp_only_layers``), sliding windows and attention biases are refused on import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.families.mixtral import MixtralConfig
from loomax.models.moe.moe import MoeConfig


def _qwen3_moe() -> MoeConfig:
    return MoeConfig(num_experts=128, num_experts_per_tok=8, norm_topk_prob=False)


@LmConfig.register_subclass("qwen3_moe")
@dataclass(frozen=True)
class Qwen3MoeConfig(MixtralConfig):
    """Qwen3-MoE decoder (Qwen team 2025): Mixtral's layout with per-head QK-norm."""

    qk_norm: bool = True
    """RMSNorm over head_size on queries and keys before rotary (Qwen 3: true)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    moe: MoeConfig = field(default_factory=_qwen3_moe)
    """Experts, routing, balance losses and the grouped matmul (the `moe` section; Qwen3-MoE: 128 experts, top 8, weights not renormalised)."""

    hf_model_type: ClassVar[str | None] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **MixtralConfig.hf_requires,
        "qk_norm": (True, "has QK-norm"),
        "sliding_window": (None, "has no sliding window"),
    }
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **MixtralConfig.hf_field_names,  # num_local_experts: transformers 5 saves that name
        "intermediate_size": None,  # the width of dense layers, which Loomax refuses
        "moe_intermediate_size": "intermediate_dim", "num_experts": "moe.num_experts",
        "norm_topk_prob": "moe.norm_topk_prob", "decoder_sparse_step": None,
        "mlp_only_layers": None, "use_sliding_window": "sliding_window",
    }  # fmt: skip
    hf_moe_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        k: v for k, v in MixtralConfig.hf_moe_requires.items() if k != "norm_topk_prob"
    }
    hf_expert_names: ClassVar[tuple[str, str, str, str]] = (
        "mlp.",
        "gate_proj",
        "up_proj",
        "down_proj",
    )

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        for key in ("num_local_experts", "router_jitter_noise", "sliding_window"):
            del out[key]
        return {
            **out,
            "num_experts": self.moe.num_experts,
            "moe_intermediate_size": self.expert_dim,
            "norm_topk_prob": self.moe.norm_topk_prob,
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen3MoeConfig:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise BadFileError(
                "config.json: dense layers (decoder_sparse_step > 1 or mlp_only_layers) are not supported"
            )
        if hf.get("use_sliding_window"):
            raise BadFileError(
                "config.json: use_sliding_window is not supported (full attention only)"
            )
        if hf.get("attention_bias"):
            raise BadFileError(
                "config.json: attention_bias is not supported by model.type qwen3_moe"
            )
        fields = cls._hf_fields({**hf, "intermediate_size": hf["moe_intermediate_size"]})
        return cls(moe=cls._hf_moe(hf, 128, 8, 0.001), **fields)
