"""IBM Granite (``GraniteForCausalLM``): Llama with four multipliers, the embeddings times
``embedding_multiplier``, each block's attention and MLP outputs times ``residual_multiplier``
before they join the residual stream, attention scores times ``attention_multiplier``
(instead of 1 / sqrt(head_dim)) and the logits divided by ``logits_scaling``.

The defaults are Granite 3.0's; transformers' ``GraniteConfig`` defaults every multiplier to
1 (plain Llama), which is what import assumes where config.json leaves one out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.config import ConfigError
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig

_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


@LmConfig.register_subclass("granite")
@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    """Granite (IBM 2024): Llama with embedding, residual, attention and logit multipliers."""

    embedding_multiplier: float = 12.0
    """Token embeddings are multiplied by this."""
    residual_multiplier: float = 0.22
    """Each block's attention and MLP outputs are multiplied by this before the residual add."""
    attention_multiplier: float = 0.0078125
    """Attention scores are multiplied by this (instead of 1 / sqrt(head_dim))."""
    logits_scaling: float = 16.0
    """Output logits are divided by this."""

    hf_model_type: ClassVar[str | None] = "granite"
    hf_architecture: ClassVar[str] = "GraniteForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        **{name: name for name in _MULTIPLIERS},
    }

    def __post_init__(self):
        super().__post_init__()
        if not self.logits_scaling:
            raise ConfigError("model.logits_scaling must not be 0 (the logits are divided by it)")

    @property
    def embed_scale(self) -> float:
        return self.embedding_multiplier

    @property
    def residual_scale(self) -> float:
        return self.residual_multiplier

    @property
    def attn_scale(self) -> float:
        return self.attention_multiplier

    @property
    def logit_scale(self) -> float:
        return 1 / self.logits_scaling

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        return super().hf_config(vocab_size) | {k: getattr(self, k) for k in _MULTIPLIERS}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> GraniteConfig:
        config = super().from_hf_config(hf)
        return dataclasses.replace(config, **{k: float(hf.get(k, 1.0)) for k in _MULTIPLIERS})
