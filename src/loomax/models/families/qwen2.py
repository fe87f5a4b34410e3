"""Qwen 2 / 2.5 (``Qwen2ForCausalLM``): Llama with biases on the query, key and value
projections (none on the output projection or the MLP).

Qwen 2's sliding windows (``use_sliding_window`` from layer ``max_window_layers`` on, or
``layer_types``) are read and written as ``sliding_window`` and ``sliding_window_pattern``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig


@LmConfig.register_subclass("qwen2")
@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """Qwen 2 (Yang et al. 2024): Llama with q/k/v biases."""

    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    hf_model_type: ClassVar[str | None] = "qwen2"
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "use_sliding_window": "sliding_window", "sliding_window": "sliding_window",
        "max_window_layers": "sliding_window_pattern", "layer_types": "sliding_window_pattern",
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: v for k, v in LlamaConfig.hf_requires.items() if "sliding_window" not in k},
        "use_bias": (False, "has biases on q/k/v only (always)"),
    }

    @property
    def qkv_bias(self) -> bool:
        return True

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        del out["attention_bias"], out["mlp_bias"]
        return {**out, **self._hf_windows()}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen2Config:
        return cls(**cls._hf_fields(hf), **cls._hf_window_fields(hf))
