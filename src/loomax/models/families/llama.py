"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, optional tied head.

Options: the gate's activation, biases, weightless norms, norms on the blocks' outputs
(``hybrid_norm``) and on the embeddings, dropout. The model is ``loomax.models.blocks.decoder``;
this file is the config and its Hugging Face side (``LlamaForCausalLM``: config.json fields
and tensor names, Linear weights [out, in]), which the other rotary families subclass.

``activation_function`` is ``hidden_act``, ``use_bias`` both ``attention_bias`` and
``mlp_bias``, ``attn_pdrop`` ``attention_dropout`` (a training setting, kept from the run on
import). Options transformers lacks are refused by export, naming the key (``hf_requires``).
Embedding and residual dropout change training only, so the exported model is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import haliax.nn as hnn
from haliax import Axis
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.attention.rotary import DefaultRotary, RotaryConfig
from loomax.models.axes import Embed, Heads, HeadSize, KvHeads, Layers, Mlp, Vocab
from loomax.models.blocks.decoder import LlamaAttention, LlamaBlock, LlamaLmModel, LlamaMlp
from loomax.models.blocks.mlp_activations import ACTIVATION_FUNCTIONS, check_activation
from loomax.models.blocks.norms import rms_norm
from loomax.models.config import LmConfig
from loomax.models.io.hf_layout import Param

__all__ = ["LlamaAttention", "LlamaBlock", "LlamaConfig", "LlamaLmModel", "LlamaMlp"]


@LmConfig.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama 2/3 style decoder (Touvron et al. 2023), with grouped-query attention."""

    seq_len: int = 2048
    """Tokens per training sequence (the `position` axis)."""
    hidden_dim: int = 4096
    """Width of the residual stream (the `embed` axis)."""
    intermediate_dim: int = 11008
    """Width of the SwiGLU MLP (the `mlp` axis)."""
    num_layers: int = 32
    """Number of transformer blocks (the `layers` axis)."""
    num_heads: int = 32
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); null = num_heads; must divide num_heads."""
    head_dim: int | None = None
    """Size of each head; null = hidden_dim / num_heads."""
    rope: RotaryConfig = field(default_factory=DefaultRotary)
    """Rotary embeddings (`type`: default, linear, llama3, yarn) and their `theta`."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the LM head."""
    qk_norm: bool = False
    """RMSNorm over head_size on queries and keys before rotary (as in OLMo 2 / Qwen 3)."""
    initializer_range: float = 0.02
    """Standard deviation of the embedding initialisation."""
    activation_function: str = "silu"
    """The gate's nonlinearity, act(gate(x)) * up(x), by its transformers name: silu (SwiGLU), gelu (GeGLU), relu, ..."""
    use_bias: bool = False
    """Biases in every attention and MLP projection (transformers' attention_bias and mlp_bias); norms have none."""
    use_layer_norm_weight: bool = True
    """A learned scale in every RMSNorm; false = plain RMS normalisation."""
    hybrid_norm: bool = False
    """Also RMSNorm the attention and MLP outputs before they join the residual stream (sandwich norm)."""
    input_embedding_norm: bool = False
    """An RMSNorm on the token embeddings, before the first block."""
    sliding_window: int | None = None
    """Sliding-window attention on every layer: a query sees the keys fewer than this many positions back, itself included (Mistral); null = all."""
    sliding_window_pattern: tuple[bool, ...] = ()
    """Which layers use sliding_window, repeated over the layers ([true, false]: every other layer from the first, Gemma 2); empty = all."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sliding_window_pattern", tuple(self.sliding_window_pattern))
        pattern = self.sliding_window_pattern
        if pattern and (self.sliding_window is None or len(pattern) > self.num_layers):
            raise ConfigError(
                "model.sliding_window_pattern needs model.sliding_window and at most "
                f"num_layers ({self.num_layers}) entries, got {list(pattern)}"
            )
        check_activation(self.activation_function)
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_kv_heads ({self.kv_heads}) must divide model.num_heads ({self.num_heads})"
            )
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by model.num_heads "
                f"({self.num_heads}), or set model.head_dim"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(
                f"model.sliding_window must be positive or null, got {self.sliding_window}"
            )
        if self.head_size % 2:
            raise ValueError(
                f"model.head_dim must be even for rotary embeddings, got {self.head_size}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads

    # Axes -------------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis(Embed, self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        return Axis(Heads, self.num_heads)

    @property
    def KvHeads(self) -> Axis:
        return Axis(KvHeads, self.kv_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis(HeadSize, self.head_size)

    @property
    def Mlp(self) -> Axis:
        return Axis(Mlp, self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis(Layers, self.num_layers)

    # Structural switches a family overrides (not config keys) --------------------------
    pre_norm: ClassVar[bool] = True
    """Norms before the attention and the MLP (false: only after them, as OLMo 2)."""
    qk_norm_scope: ClassVar[str] = "head"
    """QK-norm over each head (``head``) or over the whole projection (``projection``)."""

    scale_embeddings: ClassVar[bool] = False
    """Token embeddings times sqrt(hidden_dim), in their dtype (Gemma)."""
    embed_scale: ClassVar[float | None] = None
    """Token embeddings times this instead, in their dtype (Granite's embedding_multiplier); None = 1."""
    residual_scale: ClassVar[float | None] = None
    """Each block's attention and MLP outputs times this before the residual add (Granite); None = 1."""
    logit_scale: ClassVar[float | None] = None
    """The final hidden states, so the logits, times this (Granite: 1 / logits_scaling); None = 1."""

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query, key and value projections (Llama: ``use_bias``)."""
        return self.use_bias

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), from ``sliding_window_pattern``."""
        pattern = self.sliding_window_pattern or (True,)
        return tuple(
            self.sliding_window if pattern[i % len(pattern)] else None
            for i in range(self.num_layers)
        )

    @property
    def attn_scale(self) -> float | None:
        """What the attention scores are multiplied by; None = 1 / sqrt(head_size)."""
        return None

    @property
    def attn_logit_softcap(self) -> float | None:
        """Soft cap of the attention scores (Gemma 2); None = none."""
        return None

    @property
    def final_logit_softcap(self) -> float | None:
        """Soft cap of the output logits (Gemma 2); None = none."""
        return None

    def make_norm(self, axis) -> hnn.RmsNorm:
        """An RMSNorm over ``axis`` as configured (epsilon, learned scale or none)."""
        return rms_norm(axis, self.rms_norm_eps, use_weight=self.use_layer_norm_weight)

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> LlamaLmModel:
        return LlamaLmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        d, m = self.hidden_dim, self.intermediate_dim
        q = self.num_heads * self.head_size
        kv = self.kv_heads * self.head_size
        per_layer = 2 * d * (2 * q + 2 * kv) + 2 * 3 * d * m + self.attn_flops(causal)
        return float(self.num_layers * per_layer + 2 * d * vocab_size)

    def attn_flops(self, causal: bool = True) -> float:
        """Per-token FLOPs of QK^T and PV, averaged over the layers: a query sees ``seq_len``
        keys, or its layer's window of them; causal counts the half of the score matrix
        computed (a window of w over s keys: w - w^2 / 2s of them per query on average)."""
        s, q = self.seq_len, self.num_heads * self.head_size
        total = 0.0
        for window in self.layer_windows:
            w = min(s, window or s)
            total += (w - w * w / (2 * s)) if causal else w  # mean keys per query
        return 2 * 2 * total / self.num_layers * q

    # Hugging Face (loomax.hf.family.HfFamily) ---------------------------------------------
    hf_model_type: ClassVar[str | None] = "llama"
    hf_architecture: ClassVar[str] = "LlamaForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = ("attention_dropout", "max_position_embeddings")
    """config.json fields a run may change: dropout, the context length (rotary positions)."""
    hf_field_names: ClassVar[dict[str, str | None]] = {
        "hidden_size": "hidden_dim", "intermediate_size": "intermediate_dim",
        "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
        "max_position_embeddings": "seq_len", "rms_norm_eps": "rms_norm_eps",
        "rope_theta": "rope.theta", "rope_scaling": "rope", "rope_parameters": "rope",
        "tie_word_embeddings": "tie_word_embeddings", "hidden_act": "activation_function",
        "attention_bias": "use_bias", "mlp_bias": "use_bias", "attention_dropout": "attn_pdrop",
        "initializer_range": "initializer_range",
    }  # fmt: skip
    """Each config.json field (beside model_type, architectures, vocab_size) and its model key."""
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        "qk_norm": (False, "has no QK-norm"),
        "hybrid_norm": (False, "has no norms on the attention and MLP outputs"),
        "input_embedding_norm": (False, "has no norm on the embeddings"),
        "use_layer_norm_weight": (True, "has a learned scale in every RMSNorm"),
        "sliding_window": (None, "has no sliding window"),
        "sliding_window_pattern": ((), "has the same window on every layer"),
    }
    """What export needs of a config key, and what the HF class lacks otherwise."""

    def hf_params(self) -> list[Param]:
        """Where each HF tensor lives in the model (``model.layers.{i}.`` per layer)."""
        blk, s = "model.layers.{i}.", lambda m: m.blocks.stacked  # noqa: E731
        heads, kv = ("heads", "head_size"), ("kv_heads", "head_size")
        attn = blk + "self_attn."
        out = [
            Param("model.embed_tokens.weight", lambda m: m.embed_tokens.weight, ("vocab", "embed")),
            Param(attn + "q_proj.weight", lambda m: s(m).attn.q_proj.weight, (heads, "embed")),
            Param(attn + "k_proj.weight", lambda m: s(m).attn.k_proj.weight, (kv, "embed")),
            Param(attn + "v_proj.weight", lambda m: s(m).attn.v_proj.weight, (kv, "embed")),
            Param(attn + "o_proj.weight", lambda m: s(m).attn.o_proj.weight, ("embed", heads)),
            Param(blk + "mlp.gate_proj.weight", lambda m: s(m).mlp.gate_proj.weight, ("mlp", "embed")),
            Param(blk + "mlp.up_proj.weight", lambda m: s(m).mlp.up_proj.weight, ("mlp", "embed")),
            Param(blk + "mlp.down_proj.weight", lambda m: s(m).mlp.down_proj.weight, ("embed", "mlp")),
            Param("model.norm.weight", lambda m: m.norm.weight, ("embed",)),
        ]  # fmt: skip
        if self.pre_norm:
            out += [
                Param(blk + "input_layernorm.weight", lambda m: s(m).input_norm.weight, ("embed",)),
                Param(blk + "post_attention_layernorm.weight", lambda m: s(m).post_attn_norm.weight, ("embed",)),
            ]  # fmt: skip
        else:  # the norms on the outputs, under OLMo 2's names
            out += [
                Param(blk + "post_attention_layernorm.weight", lambda m: s(m).attn_out_norm.weight, ("embed",)),
                Param(blk + "post_feedforward_layernorm.weight", lambda m: s(m).mlp_out_norm.weight, ("embed",)),
            ]  # fmt: skip
        if self.qk_norm:
            q, k = ("head_size",), ("head_size",)
            if self.qk_norm_scope == "projection":
                q, k = (heads,), (kv,)
            out += [
                Param(attn + "q_norm.weight", lambda m: s(m).attn.q_norm.weight, q),
                Param(attn + "k_norm.weight", lambda m: s(m).attn.k_norm.weight, k),
            ]
        if self.qkv_bias:
            out += [
                Param(attn + "q_proj.bias", lambda m: s(m).attn.q_proj.bias, (heads,)),
                Param(attn + "k_proj.bias", lambda m: s(m).attn.k_proj.bias, (kv,)),
                Param(attn + "v_proj.bias", lambda m: s(m).attn.v_proj.bias, (kv,)),
            ]
        if self.use_bias:
            out += [
                Param(attn + "o_proj.bias", lambda m: s(m).attn.o_proj.bias, ("embed",)),
                Param(blk + "mlp.gate_proj.bias", lambda m: s(m).mlp.gate_proj.bias, ("mlp",)),
                Param(blk + "mlp.up_proj.bias", lambda m: s(m).mlp.up_proj.bias, ("mlp",)),
                Param(blk + "mlp.down_proj.bias", lambda m: s(m).mlp.down_proj.bias, ("embed",)),
            ]
        if not self.tie_word_embeddings:
            out.append(Param("lm_head.weight", lambda m: m.lm_head.weight, ("vocab", "embed")))
        return out

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The config.json of this model with ``vocab_size`` entries; ``ConfigError`` naming the
        key of an option the HF class lacks."""
        for key, (need, what) in self.hf_requires.items():
            if getattr(self, key) != need:
                raise ConfigError(
                    f"{self.hf_architecture} {what}: export needs model.{key}: {_yaml(need)}"
                )
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_model_type,
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_size,
            "max_position_embeddings": self.seq_len,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.hf_rope_scaling(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.activation_function,
            "attention_bias": self.use_bias,
            "mlp_bias": self.use_bias,
            "attention_dropout": self.attn_pdrop,
            "initializer_range": self.initializer_range,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        """The config of a config.json (``BadFileError`` naming a field it cannot take)."""
        bias = bool(hf.get("attention_bias", False))
        if bool(hf.get("mlp_bias", False)) != bias:
            raise BadFileError(
                f"config.json: attention_bias ({bias}) and mlp_bias ({not bias}) differ; "
                "model.use_bias sets both"
            )
        return cls(use_bias=bias, **cls._hf_fields(hf))

    def _hf_windows(self) -> dict[str, Any]:
        """config.json's window fields (Qwen 2/3's): ``use_sliding_window``, ``sliding_window``,
        ``max_window_layers`` (the leading full layers) and each layer's kind (``layer_types``)."""
        if self.sliding_window is None:
            return {"use_sliding_window": False}
        kinds = ["full_attention" if w is None else "sliding_attention" for w in self.layer_windows]
        leading = next((i for i, k in enumerate(kinds) if k != "full_attention"), len(kinds))
        return {
            "use_sliding_window": True,
            "sliding_window": self.sliding_window,
            "max_window_layers": leading,
            "layer_types": kinds,
        }

    @classmethod
    def _hf_window_fields(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """``sliding_window`` and ``sliding_window_pattern`` of config.json's ``layer_types``, or
        of ``use_sliding_window`` and ``max_window_layers`` (Qwen 2/3: sliding from that layer)."""
        n, kinds = hf["num_hidden_layers"], hf.get("layer_types")
        if kinds is None and hf.get("use_sliding_window", True) is False:
            return {"sliding_window": None}
        if kinds is None:
            kinds = ["sliding_attention"] * n
            if "use_sliding_window" in hf:
                first = hf.get("max_window_layers", 0)
                kinds = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
        pattern = tuple(k == "sliding_attention" for k in kinds)
        if hf.get("sliding_window") is None or not any(pattern):
            return {"sliding_window": None}
        return {"sliding_window": hf["sliding_window"], "sliding_window_pattern": pattern}

    @classmethod
    def _hf_fields(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """The fields every rotary family reads alike from config.json."""
        act = hf.get("hidden_act", "silu")
        if act not in ACTIVATION_FUNCTIONS:
            raise BadFileError(
                f"config.json: hidden_act {act!r} is not supported (have {sorted(ACTIVATION_FUNCTIONS)})"
            )
        heads = hf["num_attention_heads"]
        return dict(
            seq_len=hf.get("max_position_embeddings", 2048),
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope=RotaryConfig.from_hf_config(hf),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            initializer_range=hf.get("initializer_range", 0.02),
            activation_function=act,
            attn_pdrop=hf.get("attention_dropout", 0.0),
        )


def _yaml(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return "null" if value is None else str(value).lower()
