"""Gemma 3, text (``Gemma3ForCausalLM``, config.json ``model_type`` gemma3_text): Gemma 2's
block (four ``1 + w`` norms, scores times ``query_pre_attn_scalar ** -0.5``, embeddings
times sqrt(hidden), GeGLU, tied head) with QK-norm (``1 + w`` per head), five local layers
to one global (``sliding_window_pattern``, transformers' ``layer_types``) and a rotary base
per kind of layer: the global layers' ``rope`` (theta 1M, with its scaling), the local ones'
plain ``rope_local_base_freq`` (10k), switched on the layer index like the windows. No soft
caps by default.

``model.type`` is transformers' ``model_type``, ``gemma3_text``, as for every family (import
finds the family by it); ``gemma3`` there is the multimodal ``Gemma3ForConditionalGeneration``,
whose config.json import refuses. The pattern repeats over the layers; one longer than the
stack keeps its first ``num_layers`` entries, which is what it means there (transformers'
default of six entries on a two-layer model: both local). Decoding keeps a window-sized
rolling cache for the local layers and a full one for the global layers
(``models/decoding/kind_cache.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loomax.errors import BadFileError
from loomax.models.attention.rotary import DefaultRotary, RotaryConfig
from loomax.models.config import LmConfig
from loomax.models.families.gemma2 import Gemma2Config

_LOCAL_THETA, _GLOBAL_THETA = 10_000.0, 1_000_000.0  # transformers' Gemma3TextConfig defaults


@LmConfig.register_subclass("gemma3_text")
@dataclass(frozen=True)
class Gemma3TextConfig(Gemma2Config):
    """Gemma 3 (Gemma Team 2025), text: Gemma 2 with QK-norm, 5 local : 1 global layers and a rotary base per kind."""

    rope: RotaryConfig = field(default_factory=lambda: DefaultRotary(theta=_GLOBAL_THETA))
    """Rotary embeddings of the global (full-attention) layers, theta 1,000,000 by default (`type`, `theta`: rope_theta, rope_scaling)."""
    rope_local_base_freq: float = _LOCAL_THETA
    """Rotary base (theta) of the local (sliding-window) layers, plain RoPE with no scaling."""
    qk_norm: bool = True
    """RMSNorm (1 + w) over head_size on queries and keys before rotary."""
    sliding_window_pattern: tuple[bool, ...] = (True,) * 5 + (False,)
    """Which layers use sliding_window, repeated over the layers (Gemma 3: five local, then one global); longer than num_layers: its first entries."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap); null = no cap (Gemma 3 has none)."""
    final_logit_softcapping: float | None = None
    """Output logits become cap * tanh(logit / cap); null = no cap (Gemma 3 has none)."""

    hf_model_type: ClassVar[str | None] = "gemma3_text"
    hf_architecture: ClassVar[str] = "Gemma3ForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **Gemma2Config.hf_field_names,
        "rope_local_base_freq": "rope_local_base_freq",
        "sliding_window_pattern": "sliding_window_pattern",
        "use_bidirectional_attention": None,
    }
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **Gemma2Config.hf_requires,
        "qk_norm": (True, "has QK-norm"),
    }

    def __post_init__(self):
        pattern = tuple(self.sliding_window_pattern)[: self.num_layers]
        object.__setattr__(self, "sliding_window_pattern", pattern)
        super().__post_init__()
        if self.rope_local_base_freq <= 1:
            raise ValueError(
                f"model.rope_local_base_freq must be > 1, got {self.rope_local_base_freq}"
            )

    @property
    def layer_ropes(self) -> tuple[RotaryConfig, ...]:
        """Each layer's rotary: the local base on the windowed layers, ``rope`` on the others."""
        local = DefaultRotary(theta=self.rope_local_base_freq)
        return tuple(self.rope if w is None else local for w in self.layer_windows)

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        return super().hf_config(vocab_size) | {"rope_local_base_freq": self.rope_local_base_freq}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Gemma3TextConfig:
        if hf.get("use_bidirectional_attention"):
            raise BadFileError(
                "config.json: use_bidirectional_attention true is not supported for gemma3_text"
            )
        rope, local = _ropes(hf)
        n, every = (
            hf["num_hidden_layers"],
            hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)),
        )
        kinds = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)
        ]
        plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
        plain = {"tie_word_embeddings": True, **plain, "layer_types": kinds, "rope_theta": 10.0}
        config = super().from_hf_config(plain)  # a placeholder rope, replaced here
        return dataclasses.replace(config, rope=rope, rope_local_base_freq=local)


def _ropes(hf: dict[str, Any]) -> tuple[RotaryConfig, float]:
    """The global layers' rotary and the local layers' base, from transformers 5's
    ``rope_parameters`` per layer kind or the older ``rope_theta``, ``rope_scaling`` and
    ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" not in params and "sliding_attention" not in params:
        theta = params.get("rope_theta", hf.get("rope_theta", _GLOBAL_THETA))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"} or hf.get("rope_scaling")
        return RotaryConfig.from_hf(theta, scaling), hf.get("rope_local_base_freq", _LOCAL_THETA)
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise BadFileError(
            f"config.json: rope_parameters.sliding_attention {local} is not supported for "
            "gemma3_text (plain RoPE, a rope_theta only)"
        )
    theta = full.pop("rope_theta", _GLOBAL_THETA)
    return RotaryConfig.from_hf(theta, full), local.get("rope_theta", _LOCAL_THETA)
