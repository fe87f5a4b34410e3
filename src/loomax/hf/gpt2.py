"""GPT-2 <-> ``GPT2LMHeadModel``: config.json fields and tensor names (Conv1D weights are [in, out]).

Every GPT-2 option has its transformers field: ``activation_function``,
``scale_attn_by_inverse_layer_idx`` and the dropout rates (``embd_pdrop`` is
``model.embed_pdrop``); the rates are training settings, kept from the run on import.
"""

from __future__ import annotations

from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf.layout import Param
from loomax.models.gpt2 import Gpt2Config
from loomax.models.mlp_activations import ACTIVATION_FUNCTIONS

ARCHITECTURE = "GPT2LMHeadModel"
TRAINING_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
"""config.json fields that are training settings, not architecture (a run may change them)."""


def params(config: Gpt2Config) -> list[Param]:
    blk = "transformer.h.{i}."
    s = lambda m: m.blocks.stacked  # noqa: E731
    out = [
        Param("transformer.wte.weight", lambda m: m.token_embeddings.weight, ("vocab", "embed")),
        Param(
            "transformer.wpe.weight", lambda m: m.position_embeddings.weight, ("position", "embed")
        ),
        Param(blk + "ln_1.weight", lambda m: s(m).ln_attn.weight, ("embed",)),
        Param(blk + "ln_1.bias", lambda m: s(m).ln_attn.bias, ("embed",)),
        Param(
            blk + "attn.c_attn.weight",
            lambda m: s(m).attn.qkv.weight,
            ("embed", ("qkv", "heads", "head_size")),
        ),
        Param(
            blk + "attn.c_attn.bias", lambda m: s(m).attn.qkv.bias, (("qkv", "heads", "head_size"),)
        ),
        Param(
            blk + "attn.c_proj.weight",
            lambda m: s(m).attn.out.weight,
            (("heads", "head_size"), "embed"),
        ),
        Param(blk + "attn.c_proj.bias", lambda m: s(m).attn.out.bias, ("embed",)),
        Param(blk + "ln_2.weight", lambda m: s(m).ln_mlp.weight, ("embed",)),
        Param(blk + "ln_2.bias", lambda m: s(m).ln_mlp.bias, ("embed",)),
        Param(blk + "mlp.c_fc.weight", lambda m: s(m).mlp.up.weight, ("embed", "mlp")),
        Param(blk + "mlp.c_fc.bias", lambda m: s(m).mlp.up.bias, ("mlp",)),
        Param(blk + "mlp.c_proj.weight", lambda m: s(m).mlp.down.weight, ("mlp", "embed")),
        Param(blk + "mlp.c_proj.bias", lambda m: s(m).mlp.down.bias, ("embed",)),
        Param("transformer.ln_f.weight", lambda m: m.ln_final.weight, ("embed",)),
        Param("transformer.ln_f.bias", lambda m: m.ln_final.bias, ("embed",)),
    ]
    if not config.tie_word_embeddings:
        out.append(Param("lm_head.weight", lambda m: m.lm_head.weight, ("vocab", "embed")))
    return out


def hf_config(config: Gpt2Config, vocab_size: int) -> dict[str, Any]:
    if not config.use_bias:
        raise ConfigError(
            "GPT2LMHeadModel has biases in every linear layer: export needs model.use_bias: true"
        )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": config.seq_len,
        "n_ctx": config.seq_len,
        "n_embd": config.hidden_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.hidden_dim * config.mlp_ratio,
        "activation_function": config.activation_function,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "resid_pdrop": config.resid_pdrop,
        "embd_pdrop": config.embed_pdrop,
        "attn_pdrop": config.attn_pdrop,
    }


def from_hf_config(hf: dict[str, Any]) -> Gpt2Config:
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
    return Gpt2Config(
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
