"""Qwen 3 (``Qwen3ForCausalLM``): Llama with an RMSNorm over each head of the queries and keys
(``q_norm``/``k_norm``, before rotary), an explicit ``head_dim`` and no biases.

Qwen 3's sliding windows (``use_sliding_window`` from layer ``max_window_layers`` on, or
``layer_types``) are read and written as ``sliding_window`` and ``sliding_window_pattern``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig


@LmConfig.register_subclass("qwen3")
@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Qwen 3 (Qwen Team 2025): Llama with per-head QK-norm."""

    qk_norm: bool = True
    """RMSNorm over head_size on queries and keys before rotary (Qwen 3 has it)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    hf_model_type: ClassVar[str | None] = "qwen3"
    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "use_sliding_window": "sliding_window", "sliding_window": "sliding_window",
        "max_window_layers": "sliding_window_pattern", "layer_types": "sliding_window_pattern",
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: v for k, v in LlamaConfig.hf_requires.items() if "sliding_window" not in k},
        "qk_norm": (True, "always has QK-norm"),
        "use_bias": (False, "has no MLP biases"),
    }

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        del out["mlp_bias"]
        return {**out, **self._hf_windows()}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen3Config:
        if hf.get("attention_bias"):
            raise BadFileError("config.json: attention_bias true is not supported for qwen3")
        return cls(**cls._hf_fields(hf), **cls._hf_window_fields(hf))
