"""OLMoE: the Mixtral model with OLMoE's QK-norm over the whole projection and its routing.

``model.type: olmoe`` builds the same ``MixtralLmModel``; what differs is configuration:
RMSNorm over the whole query and key projections, all heads together, before rotary
(``qk_norm`` with ``qk_norm_over_heads``), and the router's top-k weights used as the
softmax gave them (``moe.norm_topk_prob: false``). Its Hugging Face names are
``hf/olmoe.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loomax.models.config import LmConfig
from loomax.models.mixtral import MixtralConfig
from loomax.models.moe import MoeConfig


def _olmoe() -> MoeConfig:
    return MoeConfig(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False)


@LmConfig.register_subclass("olmoe")
@dataclass(frozen=True)
class OlmoeConfig(MixtralConfig):
    """OLMoE decoder (Muennighoff et al. 2024): Mixtral's layout with whole-projection QK-norm."""

    qk_norm: bool = True
    """RMSNorm on queries and keys before rotary (OLMoE: true)."""
    qk_norm_over_heads: bool = True
    """With qk_norm: one RMSNorm over the whole query (key) projection, all heads together (OLMoE: true)."""
    moe: MoeConfig = field(default_factory=_olmoe)
    """Experts, routing, balance losses and the grouped matmul (the `moe` section; OLMoE: 64 experts, top 8, weights not renormalised)."""
