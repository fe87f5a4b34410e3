"""Llama <-> ``LlamaForCausalLM``: config.json fields and tensor names (Linear weights are [out, in]).

``activation_function`` is ``hidden_act``, ``use_bias`` both ``attention_bias`` and
``mlp_bias``, ``attn_pdrop`` ``attention_dropout`` (a training setting, kept from the run on
import). ``LlamaForCausalLM`` has no norms on the blocks' outputs or the embeddings and no
weightless norms: export refuses ``hybrid_norm``, ``input_embedding_norm`` and
``use_layer_norm_weight: false``, naming the key. It has no embedding or residual dropout
either; those rates change training only, so the exported model is the same without them.
"""

from __future__ import annotations

from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf.layout import Param
from loomax.models.llama import LlamaConfig
from loomax.models.mlp_activations import ACTIVATION_FUNCTIONS
from loomax.models.rotary import RotaryConfig

ARCHITECTURE = "LlamaForCausalLM"
TRAINING_KEYS = ("attention_dropout",)
"""config.json fields that are training settings, not architecture (a run may change them)."""
_UNSUPPORTED = {
    "qk_norm": (True, "has no QK-norm"),
    "qk_norm_over_heads": (True, "has no QK-norm"),
    "hybrid_norm": (True, "has no norms on the attention and MLP outputs"),
    "input_embedding_norm": (True, "has no norm on the embeddings"),
    "use_layer_norm_weight": (False, "has a learned scale in every RMSNorm"),
}


def params(config: LlamaConfig) -> list[Param]:
    blk = "model.layers.{i}."
    s = lambda m: m.blocks.stacked  # noqa: E731
    heads, kv = ("heads", "head_size"), ("kv_heads", "head_size")
    out = [
        Param("model.embed_tokens.weight", lambda m: m.embed_tokens.weight, ("vocab", "embed")),
        Param(blk + "input_layernorm.weight", lambda m: s(m).input_norm.weight, ("embed",)),
        Param(blk + "self_attn.q_proj.weight", lambda m: s(m).attn.q_proj.weight, (heads, "embed")),
        Param(blk + "self_attn.k_proj.weight", lambda m: s(m).attn.k_proj.weight, (kv, "embed")),
        Param(blk + "self_attn.v_proj.weight", lambda m: s(m).attn.v_proj.weight, (kv, "embed")),
        Param(blk + "self_attn.o_proj.weight", lambda m: s(m).attn.o_proj.weight, ("embed", heads)),
        Param(
            blk + "post_attention_layernorm.weight",
            lambda m: s(m).post_attn_norm.weight,
            ("embed",),
        ),
        Param(blk + "mlp.gate_proj.weight", lambda m: s(m).mlp.gate_proj.weight, ("mlp", "embed")),
        Param(blk + "mlp.up_proj.weight", lambda m: s(m).mlp.up_proj.weight, ("mlp", "embed")),
        Param(blk + "mlp.down_proj.weight", lambda m: s(m).mlp.down_proj.weight, ("embed", "mlp")),
        Param("model.norm.weight", lambda m: m.norm.weight, ("embed",)),
    ]
    if config.use_bias:
        out += _biases(blk, s, heads, kv)
    if not config.tie_word_embeddings:
        out.append(Param("lm_head.weight", lambda m: m.lm_head.weight, ("vocab", "embed")))
    return out


def _biases(blk: str, s, heads, kv) -> list[Param]:
    """The projections' biases (``attention_bias`` and ``mlp_bias``)."""
    where = {
        "self_attn.q_proj": (lambda m: s(m).attn.q_proj.bias, (heads,)),
        "self_attn.k_proj": (lambda m: s(m).attn.k_proj.bias, (kv,)),
        "self_attn.v_proj": (lambda m: s(m).attn.v_proj.bias, (kv,)),
        "self_attn.o_proj": (lambda m: s(m).attn.o_proj.bias, ("embed",)),
        "mlp.gate_proj": (lambda m: s(m).mlp.gate_proj.bias, ("mlp",)),
        "mlp.up_proj": (lambda m: s(m).mlp.up_proj.bias, ("mlp",)),
        "mlp.down_proj": (lambda m: s(m).mlp.down_proj.bias, ("embed",)),
    }
    return [Param(f"{blk}{name}.bias", get, dims) for name, (get, dims) in where.items()]


def hf_config(config: LlamaConfig, vocab_size: int) -> dict[str, Any]:
    for key, (bad, what) in _UNSUPPORTED.items():
        if getattr(config, key) == bad:
            raise ConfigError(
                f"LlamaForCausalLM {what}: export needs model.{key}: {str(not bad).lower()}"
            )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope.theta,
        "rope_scaling": config.rope.hf_rope_scaling(),
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": config.activation_function,
        "attention_bias": config.use_bias,
        "mlp_bias": config.use_bias,
        "attention_dropout": config.attn_pdrop,
        "initializer_range": config.initializer_range,
    }


def from_hf_config(hf: dict[str, Any]) -> LlamaConfig:
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATION_FUNCTIONS:
        raise BadFileError(
            f"config.json: hidden_act {act!r} is not supported (have {sorted(ACTIVATION_FUNCTIONS)})"
        )
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise BadFileError(
            f"config.json: attention_bias ({bias}) and mlp_bias ({not bias}) differ; "
            "model.use_bias sets both"
        )
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        seq_len=hf.get("max_position_embeddings", 2048),
        hidden_dim=hf["hidden_size"],
        intermediate_dim=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope=_rope_from_hf(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        initializer_range=hf.get("initializer_range", 0.02),
        activation_function=act,
        use_bias=bias,
        attn_pdrop=hf.get("attention_dropout", 0.0),
    )


def _rope_from_hf(hf: dict[str, Any]) -> RotaryConfig:
    """The rotary config of an HF ``config.json``: transformers >= 5 writes one
    ``rope_parameters`` mapping (with ``rope_theta``), older versions ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if not params:
        return RotaryConfig.from_hf(hf.get("rope_theta", 10000.0), hf.get("rope_scaling"))
    if (
        not isinstance(params, dict)
        or "rope_theta" not in params
        and any(isinstance(v, dict) for v in params.values())
    ):
        raise BadFileError(
            "config.json: rope_parameters per layer type are not supported (one rope for all layers)"
        )
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    return RotaryConfig.from_hf(theta, params)
