"""Mistral (``MistralForCausalLM``): Llama with sliding-window attention on every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig


@LmConfig.register_subclass("mistral")
@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """Mistral 7B (Jiang et al. 2023): Llama with a sliding attention window."""

    sliding_window: int | None = 4096
    """Sliding-window attention on every layer: a query sees the keys fewer than this many positions back, itself included; null = all."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    hf_model_type: ClassVar[str | None] = "mistral"
    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "sliding_window": "sliding_window",
    }
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: v for k, v in LlamaConfig.hf_requires.items() if k != "sliding_window"},
        "use_bias": (False, "has no biases"),
    }

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        del out["attention_bias"], out["mlp_bias"]
        return {**out, "sliding_window": self.sliding_window}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MistralConfig:
        return cls(sliding_window=hf.get("sliding_window"), **cls._hf_fields(hf))
