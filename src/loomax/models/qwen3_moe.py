"""Qwen3-MoE: the Mixtral model with Qwen 3's per-head QK-norm and its routing defaults.

``model.type: qwen3_moe`` builds the same ``MixtralLmModel`` (Llama attention and blocks,
mixture-of-experts MLPs); what differs is configuration: RMSNorm over ``head_size`` on
queries and keys before rotary (``qk_norm``), epsilon 1e-6, and the router's top-k weights
used as they are (``moe.norm_topk_prob: false``, transformers' default; checkpoints may
set it). Its Hugging Face names are ``hf/qwen3_moe.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loomax.models.config import LmConfig
from loomax.models.mixtral import MixtralConfig
from loomax.models.moe import MoeConfig


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
