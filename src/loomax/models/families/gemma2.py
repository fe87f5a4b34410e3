"""Gemma 2 (``Gemma2ForCausalLM``): Llama with four norms per block (before and after the
attention and the MLP, ``hybrid_norm``), RMSNorms scaled by ``1 + weight`` in float32,
attention scores times ``query_pre_attn_scalar ** -0.5`` and soft-capped, soft-capped final
logits, embeddings times sqrt(hidden_dim), a GeGLU (tanh) MLP, tied embeddings and a sliding
window on every other layer (the first included).

Soft-capped attention runs on the ``vanilla`` and ``blockwise`` backends (``auto`` picks one
by length); the splash, xla and cudnn kernels have no cap here, so they are refused by name. The loss with capped logits
is blocked over tokens without vocabulary blocks (``cross_entropy_vocab_block_size`` null).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.attention.attention import CAPPING_BACKENDS
from loomax.models.blocks.norms import OffsetRmsNorm
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig
from loomax.models.io.hf_layout import Param

_NORMS = {  # HF name -> the block's norm
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "post_attn_norm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


@LmConfig.register_subclass("gemma2")
@dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    """Gemma 2 (Gemma Team 2024): sandwich norms, soft-capping, alternating local attention."""

    activation_function: str = "gelu_pytorch_tanh"
    """The gate's nonlinearity (GeGLU with GELU's tanh approximation)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = True
    """Use the token embedding matrix as the LM head."""
    hybrid_norm: bool = True
    """Norms after the attention and the MLP too (Gemma 2 has four per block)."""
    sliding_window: int | None = 4096
    """Sliding-window attention on the layers of sliding_window_pattern; null = all."""
    sliding_window_pattern: tuple[bool, ...] = (True, False)
    """Which layers use sliding_window, repeated over the layers (Gemma 2: every other, from the first)."""
    query_pre_attn_scalar: int = 256
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (instead of head_dim's); a whole number, as transformers' Gemma2Config declares it."""
    attn_logit_softcapping: float | None = 50.0
    """Attention scores become cap * tanh(score / cap); null = no cap."""
    final_logit_softcapping: float | None = 30.0
    """Output logits become cap * tanh(logit / cap); null = no cap."""

    scale_embeddings: ClassVar[bool] = True
    hf_model_type: ClassVar[str | None] = "gemma2"
    hf_architecture: ClassVar[str] = "Gemma2ForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "hidden_activation": "activation_function", "query_pre_attn_scalar": "query_pre_attn_scalar",
        "sliding_window": "sliding_window", "layer_types": "sliding_window_pattern",
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        "qk_norm": (False, "has no QK-norm"),
        "hybrid_norm": (True, "has norms before and after the attention and the MLP"),
        "input_embedding_norm": (False, "has no norm on the embeddings"),
        "use_layer_norm_weight": (True, "has a learned scale in every RMSNorm"),
        "use_bias": (False, "has no biases"),
        "tie_word_embeddings": (True, "ties the LM head to the embeddings"),
    }

    def __post_init__(self):
        super().__post_init__()
        capping = ("auto", *CAPPING_BACKENDS)
        if self.attn_logit_softcapping is not None and self.attn_backend not in capping:
            raise ConfigError(
                f"model.attn_logit_softcapping needs model.attn_backend one of {capping} (the "
                f"backends that cap scores), got {self.attn_backend!r}"
            )
        if self.final_logit_softcapping is not None and self.cross_entropy_vocab_block_size:
            raise ConfigError(
                "model.final_logit_softcapping needs model.cross_entropy_vocab_block_size null"
            )
        scalar = self.query_pre_attn_scalar
        if scalar <= 0 or scalar != int(scalar):
            raise ConfigError(
                f"model.query_pre_attn_scalar must be a positive whole number, got {scalar}"
            )
        object.__setattr__(self, "query_pre_attn_scalar", int(scalar))  # 256.0 from Python: 256

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def attn_logit_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def final_logit_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def make_norm(self, axis) -> OffsetRmsNorm:
        return OffsetRmsNorm.init(axis, self.rms_norm_eps)

    def hf_params(self) -> list[Param]:
        blk = "model.layers.{i}."
        out = [p for p in super().hf_params() if "layernorm" not in p.hf_name]
        for hf, ours in _NORMS.items():
            where = lambda m, ours=ours: getattr(m.blocks.stacked, ours).weight  # noqa: E731
            out.append(Param(f"{blk}{hf}.weight", where, ("embed",)))
        return out

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        del out["mlp_bias"]
        kinds = ["full_attention" if w is None else "sliding_attention" for w in self.layer_windows]
        return out | {
            "hidden_activation": out.pop("hidden_act"),
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "layer_types": kinds,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Gemma2Config:
        if hf.get("attention_bias"):
            raise BadFileError("config.json: attention_bias true is not supported for gemma2")
        n = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        fields = cls._hf_fields({**hf, "hidden_act": act})
        return cls(
            sliding_window=hf.get("sliding_window"),
            sliding_window_pattern=tuple(k == "sliding_attention" for k in kinds),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            **fields,
        )
