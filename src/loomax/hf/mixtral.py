"""Mixtral <-> ``MixtralForCausalLM``: Llama's fields and tensors, the MLP replaced by experts.

Hub checkpoints hold one tensor per expert, ``model.layers.N.block_sparse_moe.experts.E.
{w1,w2,w3}.weight`` (w1 the gate, w3 the up, w2 the down projection) and the router
``...block_sparse_moe.gate.weight``; those are the names read and written here (transformers
>= 5 fuses the experts on load). ``router_aux_loss_coef`` is HF's load-balance coefficient,
whose loss is k at perfect balance, Loomax's 1: the weight is multiplied by k on import and
divided on export. ``MixtralForCausalLM`` routes by softmax, renormalises the top k and drops
nothing, with no shared experts or biases: export refuses other settings, naming the key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf import llama as hf_llama
from loomax.hf.layout import Param
from loomax.models.mixtral import MixtralConfig
from loomax.models.moe import MoeConfig

ARCHITECTURE = "MixtralForCausalLM"
TRAINING_KEYS = ("attention_dropout", "router_aux_loss_coef")
"""config.json fields that are training settings, not architecture (a run may change them)."""
_MOE_UNSUPPORTED = {
    "score_function": ("softmax", "routes by a softmax"),
    "norm_topk_prob": (True, "renormalises the top-k weights"),
    "num_shared_experts": (0, "has no shared experts"),
    "capacity_factor": (None, "drops no tokens"),
    "expert_intermediate_dim": (None, "sizes experts by intermediate_size"),
}


def params(config: MixtralConfig) -> list[Param]:
    blk = "model.layers.{i}."
    moe = blk + "block_sparse_moe."
    s = lambda m: m.blocks.stacked  # noqa: E731
    dense = [
        p for p in hf_llama.params(replace(config, use_bias=False)) if ".mlp." not in p.hf_name
    ]
    return dense + [
        Param(moe + "gate.weight", lambda m: s(m).mlp.router.weight, ("experts", "embed")),
        Param(moe + "experts.{e}.w1.weight", lambda m: s(m).mlp.gate, ("mlp", "embed")),
        Param(moe + "experts.{e}.w3.weight", lambda m: s(m).mlp.up, ("mlp", "embed")),
        Param(moe + "experts.{e}.w2.weight", lambda m: s(m).mlp.down, ("embed", "mlp")),
    ]


def hf_config(config: MixtralConfig, vocab_size: int) -> dict[str, Any]:
    if config.use_bias:
        raise ConfigError(f"{ARCHITECTURE} has no biases: export needs model.use_bias: false")
    for key, (want, what) in _MOE_UNSUPPORTED.items():
        if getattr(config.moe, key) != want:
            raise ConfigError(f"{ARCHITECTURE} {what}: export needs model.moe.{key}: {want}")
    out = hf_llama.hf_config(config, vocab_size)
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    k = config.moe.num_experts_per_tok
    out.update(
        architectures=[ARCHITECTURE],
        model_type="mixtral",
        num_local_experts=config.moe.num_experts,
        num_experts_per_tok=k,
        router_aux_loss_coef=config.moe.load_balance_loss_weight / k,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    return out


def from_hf_config(hf: dict[str, Any]) -> MixtralConfig:
    if hf.get("sliding_window") is not None:
        raise BadFileError(
            f"config.json: sliding_window {hf['sliding_window']} is not supported (full attention only)"
        )
    llama = hf_llama.from_hf_config({**hf, "attention_bias": False, "mlp_bias": False})
    k = hf.get("num_experts_per_tok", 2)
    moe = MoeConfig(
        num_experts=hf.get("num_local_experts", 8),
        num_experts_per_tok=k,
        load_balance_loss_weight=hf.get("router_aux_loss_coef", 0.001) * k,
    )
    fields = {f: getattr(llama, f) for f in llama.__dataclass_fields__}
    return MixtralConfig(**fields, moe=moe)
