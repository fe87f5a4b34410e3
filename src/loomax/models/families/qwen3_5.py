"""Qwen3.5's dense text model (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``): the
Qwen3.5-MoE layout (``qwen3_5_moe.py``: the DeltaNet's four HF projections, the rotary) with a
SwiGLU MLP (``mlp.{gate,up,down}_proj``, ``intermediate_dim``) in every layer instead of the
experts. The model is Qwen3-Next's (``models/blocks/qwen3_next_model.py``, ``has_experts``
false); the inherited ``moe`` section is not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.models.config import LmConfig
from loomax.models.families.qwen3_5_moe import Qwen35MoeConfig
from loomax.models.families.qwen3_next import _param
from loomax.models.io.hf_layout import Param

_EXPERT_KEYS = (
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
)  # fmt: skip


@LmConfig.register_subclass("qwen3_5_text")
@dataclass(frozen=True)
class Qwen35Config(Qwen35MoeConfig):
    """Qwen3.5 (dense, text): Gated DeltaNet and gated full-attention layers, a SwiGLU MLP each."""

    intermediate_dim: int = 12288
    """Width of each layer's SwiGLU MLP (intermediate_size)."""

    @property
    def has_experts(self) -> bool:
        return False

    def _shapes(self, vocab: int) -> list[tuple[Param, tuple[int, ...]]]:
        d, w = self.hidden_dim, self.intermediate_dim
        out = [(p, s) for p, s in super()._shapes(vocab) if ".mlp." not in p.hf_name]
        for i in range(self.num_layers):
            m = f"model.layers.{i}.mlp."
            out += [(_param(m + "gate_proj.weight"), (w, d)), (_param(m + "up_proj.weight"), (w, d)),
                    (_param(m + "down_proj.weight"), (d, w))]  # fmt: skip
        return out

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Qwen3-Next's count with each layer's experts replaced by the SwiGLU MLP."""
        d, k = self.hidden_dim, self.moe.num_experts_per_tok
        moe = (
            2 * 3 * d * (k * self.expert_dim + self.shared_expert_dim)
            + 2 * d * self.moe.num_experts
        )
        total = super().flops_per_token(vocab_size, causal=causal)
        return float(total + self.num_layers * (2 * 3 * d * self.intermediate_dim - moe))

    hf_model_type: ClassVar[str | None] = "qwen3_5_text"
    hf_architecture: ClassVar[str] = "Qwen3_5ForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = ("attention_dropout", "max_position_embeddings")
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **{k: v for k, v in Qwen35MoeConfig.hf_field_names.items() if k not in _EXPERT_KEYS},
        "intermediate_size": "intermediate_dim",
    }

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = {k: v for k, v in super().hf_config(vocab_size).items() if k not in _EXPERT_KEYS}
        return out | {"intermediate_size": self.intermediate_dim}
