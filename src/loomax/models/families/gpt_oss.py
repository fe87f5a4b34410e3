"""gpt-oss (``GptOssForCausalLM``, OpenAI 2025): Mixtral's model with attention sinks,
alternating 128-token windows, biased experts with a clamped SwiGLU, and YaRN rotary.

``model.type: gpt_oss`` builds the ``MixtralLmModel`` (Llama attention and norms, a mixture
of experts in every block) with: a learned sink logit per query head in every attention's
softmax (``attention_sinks``: ``models/attention/sinks.py``, on the vanilla, blockwise and
splash backends, the blockwise ring and decoding), biases on q/k/v/o (``use_bias``), a
sliding window of 128 on every other layer from the first (``sliding_window_pattern``,
transformers' ``layer_types``), YaRN (factor 32 over 4,096 positions, its ramp's ends not
rounded: ``truncate: false``), and experts with biases on the router and on every
projection and gpt-oss's clamped SwiGLU (``moe.expert_bias``, ``moe.swiglu_limit``,
``moe.swiglu_alpha``). Routing: the top k router logits' softmax, which is the softmax over
all experts renormalised over the k (``norm_topk_prob: true``).

Its HF side: per layer ``self_attn.sinks`` and the q/k/v/o biases; the router
``mlp.router.{weight,bias}``; the experts as four stacked tensors, ``mlp.experts.gate_up_proj``
``[experts, hidden, 2 x width]`` (gate and up interleaved on the last dimension: the gate at
even, the up projection at odd indices), its bias ``gate_up_proj_bias``, ``down_proj``
``[experts, width, hidden]`` and ``down_proj_bias``. Hub checkpoints of OpenAI's weights hold
the experts in MXFP4 blocks and scales, which import refuses (the tensors are missing);
transformers' dequantised saves import. ``router_aux_loss_coef`` is scaled by k as Mixtral's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.attention.rotary import RotaryConfig, YarnRotary
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig
from loomax.models.families.mixtral import MixtralConfig
from loomax.models.io.hf_layout import Param
from loomax.models.moe.moe import MoeConfig

_ALPHA, _LIMIT = 1.702, 7.0  # transformers' GptOssConfig swiglu_alpha, swiglu_limit


def _moe() -> MoeConfig:
    return MoeConfig(
        num_experts=128, num_experts_per_tok=4, expert_bias=True, swiglu_limit=_LIMIT,
        swiglu_alpha=_ALPHA, load_balance_loss_weight=0.004,
    )  # fmt: skip


def _yarn() -> YarnRotary:
    return YarnRotary(theta=150_000.0, factor=32.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0, truncate=False)  # fmt: skip


@dataclass(frozen=True)
class _GateUp(Param):
    """One half of gpt-oss's fused ``gate_up_proj`` (or its bias), interleaved on the last
    dimension (``half`` 0: the gate, at even indices; 1: the up projection, at odd ones).
    The gate's entry (``up`` set: where the up projection lives) exports the whole tensor."""

    half: int = 0
    up: Any = None

    def export(self, model) -> dict[str, np.ndarray]:
        if self.up is None:
            return {}
        gate = super().export(model)
        up = Param(self.hf_name, self.up, self.dims).export(model)
        return {n: np.stack([g, up[n]], -1).reshape(*g.shape[:-1], -1) for n, g in gate.items()}

    def _take(self, tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
        return super()._take(tensors, name)[..., self.half :: 2]


@LmConfig.register_subclass("gpt_oss")
@dataclass(frozen=True)
class GptOssConfig(MixtralConfig):
    """gpt-oss (OpenAI 2025): sinks, alternating local attention, biased clamped-SwiGLU experts."""

    seq_len: int = 4096
    """Tokens per training sequence (the `position` axis)."""
    hidden_dim: int = 2880
    """Width of the residual stream (the `embed` axis)."""
    intermediate_dim: int = 2880
    """Width of each expert's MLP (the `mlp` axis)."""
    num_layers: int = 36
    """Number of transformer blocks (the `layers` axis)."""
    num_heads: int = 64
    """Query heads."""
    num_kv_heads: int | None = 8
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int | None = 64
    """Size of each head; null = hidden_dim / num_heads."""
    rope: RotaryConfig = field(default_factory=_yarn)
    """Rotary embeddings: YaRN, factor 32 over 4,096 positions, theta 150,000 (`type`, `theta`, ...)."""
    use_bias: bool = True
    """Biases on the query, key, value and output projections (transformers' attention_bias)."""
    attention_sinks: bool = True
    """A learned logit per query head in every attention's softmax denominator (its sink)."""
    sliding_window: int | None = 128
    """Sliding-window attention on the layers of sliding_window_pattern; null = all."""
    sliding_window_pattern: tuple[bool, ...] = (True, False)
    """Which layers use sliding_window, repeated over the layers (gpt-oss: every other, from the first)."""
    moe: MoeConfig = field(default_factory=_moe)
    """Experts, routing, balance losses and the grouped matmul (gpt-oss: 128 experts, top 4, biases, clamped SwiGLU)."""

    hf_model_type: ClassVar[str | None] = "gpt_oss"
    hf_architecture: ClassVar[str] = "GptOssForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **MixtralConfig.hf_field_names,
        "layer_types": "sliding_window_pattern", "swiglu_alpha": "moe.swiglu_alpha",
        "swiglu_limit": "moe.swiglu_limit", "attention_bias": "use_bias",
        "output_router_logits": None, "mlp_bias": None,
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: v for k, v in MixtralConfig.hf_requires.items() if k != "sliding_window_pattern"},
        "use_bias": (True, "has biases on q, k, v and o"),
        "attention_sinks": (True, "has attention sinks"),
    }
    hf_moe_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **MixtralConfig.hf_moe_requires,
        "expert_bias": (True, "has biases on the router and the experts"),
    }

    def __post_init__(self):
        super().__post_init__()
        if not self.moe.expert_bias and self.moe.swiglu_limit is not None:
            raise ConfigError("model.moe.swiglu_limit needs model.moe.expert_bias (gpt-oss)")

    def hf_params(self) -> list[Param]:
        """Mixtral's attention and norm tensors (with q/k/v/o biases), the sinks, the router and
        the four stacked expert tensors."""
        s = lambda m: m.blocks.stacked  # noqa: E731
        blk = "model.layers.{i}."
        moe, ex = blk + "mlp.", blk + "mlp.experts."
        attn = [p for p in LlamaConfig.hf_params(self) if ".mlp." not in p.hf_name]
        mlp = lambda m: s(m).mlp  # noqa: E731
        return attn + [
            Param(blk + "self_attn.sinks", lambda m: s(m).attn.sinks, ("heads",)),
            Param(moe + "router.weight", lambda m: mlp(m).router.weight, ("experts", "embed")),
            Param(moe + "router.bias", lambda m: mlp(m).router.bias, ("experts",)),
            _GateUp(ex + "gate_up_proj", lambda m: mlp(m).gate, ("experts", "embed", "mlp"),
                    half=0, up=lambda m: mlp(m).up),
            _GateUp(ex + "gate_up_proj", lambda m: mlp(m).up, ("experts", "embed", "mlp"), half=1),
            _GateUp(ex + "gate_up_proj_bias", lambda m: mlp(m).gate_bias, ("experts", "mlp"),
                    half=0, up=lambda m: mlp(m).up_bias),
            _GateUp(ex + "gate_up_proj_bias", lambda m: mlp(m).up_bias, ("experts", "mlp"), half=1),
            Param(ex + "down_proj", lambda m: mlp(m).down, ("experts", "mlp", "embed")),
            Param(ex + "down_proj_bias", lambda m: mlp(m).down_bias, ("experts", "embed")),
        ]  # fmt: skip

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        if self.moe.swiglu_limit is None:
            raise ConfigError(
                "GptOssForCausalLM has the clamped SwiGLU: export needs model.moe.swiglu_limit"
            )
        out = super().hf_config(vocab_size)
        del out["router_jitter_noise"]
        kinds = ["full_attention" if w is None else "sliding_attention" for w in self.layer_windows]
        return {
            **out,
            "layer_types": kinds,
            "attention_bias": True,
            "swiglu_alpha": self.moe.swiglu_alpha,
            "swiglu_limit": self.moe.swiglu_limit,
            "output_router_logits": False,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> GptOssConfig:
        if not hf.get("attention_bias", True):
            raise BadFileError("config.json: attention_bias false is not supported for gpt_oss")
        if "rope_parameters" not in hf and "rope_scaling" not in hf:
            hf = {**hf, "rope_parameters": {"rope_theta": 150_000.0, **_yarn().hf_rope_scaling()}}
        kinds = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
        fields = cls._hf_fields({"tie_word_embeddings": False, **hf})
        moe = replace(
            cls._hf_moe(hf, 128, 4, 0.001), expert_bias=True,
            swiglu_alpha=hf.get("swiglu_alpha", _ALPHA), swiglu_limit=hf.get("swiglu_limit", _LIMIT),
        )  # fmt: skip
        window = hf.get("sliding_window")
        pattern = tuple(k == "sliding_attention" for k in kinds)
        if window is None or not any(pattern):
            window, pattern = None, ()
        return cls(sliding_window=window, sliding_window_pattern=pattern, moe=moe, **fields)
