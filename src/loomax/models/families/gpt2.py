"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied or untied LM head, dropout.

The model is ``loomax.models.blocks.gpt2_model``; this file is the config and its Hugging Face side
(``GPT2LMHeadModel``: config.json fields and tensor names; Conv1D weights are [in, out]).
Every GPT-2 option has its transformers field: ``activation_function``,
``scale_attn_by_inverse_layer_idx`` and the dropout rates (``embd_pdrop`` is
``model.embed_pdrop``); the rates are training settings, kept from the run on import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from haliax import Axis
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.axes import Embed, Heads, HeadSize, Layers, Mlp, Position, Vocab
from loomax.models.blocks.gpt2_model import Gpt2Attention, Gpt2Block, Gpt2LmModel, Gpt2Mlp
from loomax.models.blocks.mlp_activations import ACTIVATION_FUNCTIONS, check_activation
from loomax.models.config import LmConfig
from loomax.models.io.hf_layout import Param

__all__ = ["Gpt2Attention", "Gpt2Block", "Gpt2Config", "Gpt2LmModel", "Gpt2Mlp"]


@LmConfig.register_subclass("gpt2")
@dataclass(frozen=True)
class Gpt2Config(LmConfig):
    """GPT-2 (Radford et al. 2019) with configurable size."""

    hidden_dim: int = 768
    """Width of the residual stream (the `embed` axis)."""
    num_layers: int = 12
    """Number of transformer blocks (the `layers` axis)."""
    num_heads: int = 12
    """Attention heads; `hidden_dim` must be divisible by it."""
    mlp_ratio: int = 4
    """MLP width as a multiple of `hidden_dim` (the `mlp` axis)."""
    layer_norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""
    tie_word_embeddings: bool = True
    """Use the token embedding matrix as the LM head (as GPT-2 does)."""
    use_bias: bool = True
    """Biases in the linear layers."""
    initializer_range: float = 0.02
    """Standard deviation of the embedding initialisation."""
    activation_function: str = "gelu_new"
    """The MLP's nonlinearity, by its transformers name: gelu_new (tanh GELU), gelu, relu, silu, quick_gelu, relu2, ..."""
    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide each layer's attention scores by its index + 1 (as transformers' GPT-2 option)."""

    def __post_init__(self):
        super().__post_init__()
        check_activation(self.activation_function)
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by model.num_heads ({self.num_heads})"
            )
        for name in ("hidden_dim", "num_layers", "num_heads", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")

    # Axes -------------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis(Embed, self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        return Axis(Heads, self.num_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis(HeadSize, self.hidden_dim // self.num_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis(Mlp, self.hidden_dim * self.mlp_ratio)

    @property
    def Layers(self) -> Axis:
        return Axis(Layers, self.num_layers)

    @property
    def Pos(self) -> Axis:
        return Axis(Position, self.seq_len)

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> Gpt2LmModel:
        return Gpt2LmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        d, m, s = self.hidden_dim, self.hidden_dim * self.mlp_ratio, self.seq_len
        attn = (2 if causal else 4) * s * d  # QK^T and PV: the causal half, or the full square
        per_layer = 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * m + attn  # qkv, out, mlp, attn
        return float(self.num_layers * per_layer + 2 * d * vocab_size)

    # Hugging Face (loomax.hf.family.HfFamily) ---------------------------------------------
    hf_model_type: ClassVar[str | None] = "gpt2"
    hf_architecture: ClassVar[str] = "GPT2LMHeadModel"
    hf_run_keys: ClassVar[tuple[str, ...]] = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
    """config.json fields a run may change (the dropout rates)."""
    hf_field_names: ClassVar[dict[str, str | None]] = {
        "n_positions": "seq_len", "n_ctx": "seq_len", "n_embd": "hidden_dim",
        "n_layer": "num_layers", "n_head": "num_heads", "n_inner": "mlp_ratio",
        "activation_function": "activation_function", "layer_norm_epsilon": "layer_norm_epsilon",
        "initializer_range": "initializer_range", "tie_word_embeddings": "tie_word_embeddings",
        "scale_attn_weights": None,
        "scale_attn_by_inverse_layer_idx": "scale_attn_by_inverse_layer_idx",
        "resid_pdrop": "resid_pdrop", "embd_pdrop": "embed_pdrop", "attn_pdrop": "attn_pdrop",
    }  # fmt: skip
    """Each config.json field (beside model_type, architectures, vocab_size) and the model key
    it is (None: one Loomax fixes, e.g. always true); ``loomax.hf.config_json`` reads it."""

    def hf_params(self) -> list[Param]:
        """Where each HF tensor lives in the model (``transformer.h.{i}.`` per layer)."""
        blk, s = "transformer.h.{i}.", lambda m: m.blocks.stacked  # noqa: E731
        qkv, heads = ("qkv", "heads", "head_size"), ("heads", "head_size")
        out = [
            Param("transformer.wte.weight", lambda m: m.token_embeddings.weight, ("vocab", "embed")),
            Param("transformer.wpe.weight", lambda m: m.position_embeddings.weight, ("position", "embed")),
            Param(blk + "ln_1.weight", lambda m: s(m).ln_attn.weight, ("embed",)),
            Param(blk + "ln_1.bias", lambda m: s(m).ln_attn.bias, ("embed",)),
            Param(blk + "attn.c_attn.weight", lambda m: s(m).attn.qkv.weight, ("embed", qkv)),
            Param(blk + "attn.c_attn.bias", lambda m: s(m).attn.qkv.bias, (qkv,)),
            Param(blk + "attn.c_proj.weight", lambda m: s(m).attn.out.weight, (heads, "embed")),
            Param(blk + "attn.c_proj.bias", lambda m: s(m).attn.out.bias, ("embed",)),
            Param(blk + "ln_2.weight", lambda m: s(m).ln_mlp.weight, ("embed",)),
            Param(blk + "ln_2.bias", lambda m: s(m).ln_mlp.bias, ("embed",)),
            Param(blk + "mlp.c_fc.weight", lambda m: s(m).mlp.up.weight, ("embed", "mlp")),
            Param(blk + "mlp.c_fc.bias", lambda m: s(m).mlp.up.bias, ("mlp",)),
            Param(blk + "mlp.c_proj.weight", lambda m: s(m).mlp.down.weight, ("mlp", "embed")),
            Param(blk + "mlp.c_proj.bias", lambda m: s(m).mlp.down.bias, ("embed",)),
            Param("transformer.ln_f.weight", lambda m: m.ln_final.weight, ("embed",)),
            Param("transformer.ln_f.bias", lambda m: m.ln_final.bias, ("embed",)),
        ]  # fmt: skip
        if not self.tie_word_embeddings:
            out.append(Param("lm_head.weight", lambda m: m.lm_head.weight, ("vocab", "embed")))
        return out

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The config.json of this model with ``vocab_size`` entries."""
        if not self.use_bias:
            raise ConfigError(
                "GPT2LMHeadModel has biases in every linear layer: export needs model.use_bias: true"
            )
        return {
            "architectures": [self.hf_architecture],
            "model_type": "gpt2",
            "vocab_size": vocab_size,
            "n_positions": self.seq_len,
            "n_ctx": self.seq_len,
            "n_embd": self.hidden_dim,
            "n_layer": self.num_layers,
            "n_head": self.num_heads,
            "n_inner": self.hidden_dim * self.mlp_ratio,
            "activation_function": self.activation_function,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "resid_pdrop": self.resid_pdrop,
            "embd_pdrop": self.embed_pdrop,
            "attn_pdrop": self.attn_pdrop,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Gpt2Config:
        """The config of a config.json (``BadFileError`` naming a field it cannot take)."""
        d = hf["n_embd"]
        inner = hf.get("n_inner") or 4 * d
        if inner % d:
            raise BadFileError(f"config.json: n_inner ({inner}) must be a multiple of n_embd ({d})")
        act = hf.get("activation_function", "gelu_new")
        if act not in ACTIVATION_FUNCTIONS:
            raise BadFileError(
                f"config.json: activation_function {act!r} is not supported (have {sorted(ACTIVATION_FUNCTIONS)})"
            )
        if not hf.get("scale_attn_weights", True):
            raise BadFileError("config.json: scale_attn_weights false is not supported")
        return cls(
            seq_len=hf["n_positions"],
            hidden_dim=d,
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            mlp_ratio=inner // d,
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            initializer_range=hf.get("initializer_range", 0.02),
            activation_function=act,
            scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False),
            embed_pdrop=hf.get("embd_pdrop", 0.1),  # transformers' default
            resid_pdrop=hf.get("resid_pdrop", 0.1),  # transformers' default
            attn_pdrop=hf.get("attn_pdrop", 0.1),  # transformers' default
        )
