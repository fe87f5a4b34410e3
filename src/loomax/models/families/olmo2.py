"""OLMo 2 (``Olmo2ForCausalLM``): Llama with the norms after the attention and the MLP
instead of before (``x + rms(attn(x))``, ``x + rms(mlp(x))``) and QK-norm over the whole
query and key projections (before the head split), no biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig


@LmConfig.register_subclass("olmo2")
@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    """OLMo 2 (OLMo et al. 2024): post-norm blocks, QK-norm over the whole projection."""

    qk_norm: bool = True
    """RMSNorm over the whole query and key projections, before rotary (OLMo 2 has it)."""

    pre_norm: ClassVar[bool] = False
    qk_norm_scope: ClassVar[str] = "projection"
    hf_model_type: ClassVar[str | None] = "olmo2"
    hf_architecture: ClassVar[str] = "Olmo2ForCausalLM"
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        "qk_norm": (True, "always has QK-norm"),
        "hybrid_norm": (False, "has its norms after the blocks only"),
        "input_embedding_norm": (False, "has no norm on the embeddings"),
        "use_layer_norm_weight": (True, "has a learned scale in every RMSNorm"),
        "use_bias": (False, "has no biases"),
        "sliding_window": (None, "has no sliding window"),
    }

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        del out["mlp_bias"]
        return out

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Olmo2Config:
        if hf.get("attention_bias"):
            raise BadFileError("config.json: attention_bias true is not supported for olmo2")
        return cls(**cls._hf_fields(hf))
