"""LoRA on a mixture of experts' stacked expert weights: the surgery on ``MoeMlp``.

A ``MoeMlp``'s expert weights are named as its parameters, ``<layer>.gate``, ``.up`` and
``.down`` (e.g. ``blocks.stacked.mlp.up``), and ``model.lora.targets`` selects them by those
names as it selects linear layers. Each selected weight gets an ``ExpertAdapter``
(``models/moe/expert_adapter.py``: per-expert A and B, batched over the expert axis) beside
it, in the layer's ``gate_lora`` / ``up_lora`` / ``down_lora``; its arrays are named
``<layer>.gate_lora.lora_a`` / ``.lora_b``, so ``model.lora``'s freeze pattern trains them
and nothing of the base. Expert adapters take no dropout, no quantised base and no DoRA: a
config asking for one of them on experts is refused.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import equinox as eqx
import haliax as hax
import jax
from haliax import Axis

from loomax.config import ConfigError
from loomax.models.axes import Embed, Mlp
from loomax.models.lora.config import LoraConfig
from loomax.models.moe.expert_adapter import RANK, ExpertAdapter, adapted_weight
from loomax.models.moe.moe import MoeMlp
from loomax.tree_paths import path_name

EXPERT_WEIGHTS = {"gate": (Embed, Mlp), "up": (Embed, Mlp), "down": (Mlp, Embed)}
"""``MoeMlp``'s expert weights and their (input, output) axes."""


def is_moe(x: Any) -> bool:
    return isinstance(x, MoeMlp)


def expert_weight_names(model: Any) -> list[str]:
    """The dotted names of ``model``'s expert weights (what ``model.lora.targets`` matches)."""
    names: list[str] = []

    def visit(path, node):
        if is_moe(node):
            names.extend(f"{path_name(path, '.')}.{w}" for w in EXPERT_WEIGHTS)
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=is_moe)
    return names


def new_adapter(weight, In: str, Out: str, config: LoraConfig, key) -> ExpertAdapter:
    """A fresh adapter on ``weight`` (its other axes in front): A ~ N(0, 1/fan_in), B = 0."""
    front = tuple(a for a in weight.axes if a.name not in (In, Out))  # layers, experts
    rank = Axis(RANK, config.rank)
    ins, outs = weight.resolve_axis(In), weight.resolve_axis(Out)
    a = hax.random.normal(key, (*front, rank, ins)) * (ins.size**-0.5)
    b = hax.zeros((*front, outs, rank), dtype=weight.dtype)
    return ExpertAdapter(a.astype(weight.dtype), b, In, Out, config.scale)


def adapt_experts(mlp: MoeMlp, name: str, compiled: list[re.Pattern], config: LoraConfig, root):
    """``mlp`` (at dotted ``name``) with an adapter on each expert weight ``compiled`` matches."""
    for field, (In, Out) in EXPERT_WEIGHTS.items():
        full = f"{name}.{field}"
        if getattr(mlp, f"{field}_lora") is not None or not any(r.search(full) for r in compiled):
            continue
        if config.dropout > 0:
            raise ConfigError(
                f"model.lora.dropout ({config.dropout}) is not applied to expert weights "
                f"({full} matches model.lora.targets): set it to 0 or leave the experts out"
            )
        if config.dora:
            raise ConfigError(
                f"model.lora.dora decomposes linear layers' weights, not expert weights "
                f"({full} matches model.lora.targets): leave the experts out of the targets"
            )
        if config.quantize_base != "none":
            raise ConfigError(
                f"model.lora.quantize_base ({config.quantize_base}) does not quantise expert "
                f"weights ({full} matches model.lora.targets): use none or leave the experts out"
            )
        key = jax.random.fold_in(root, zlib.crc32(full.encode()))
        adapter = new_adapter(getattr(mlp, field), In, Out, config, key)
        mlp = eqx.tree_at(
            lambda m, f=field: getattr(m, f"{f}_lora"), mlp, adapter, is_leaf=lambda x: x is None
        )
    return mlp


def merge_experts(mlp: MoeMlp) -> MoeMlp:
    """``mlp`` with its expert adapters folded into the expert weights (and dropped)."""
    for field in EXPERT_WEIGHTS:
        merged = adapted_weight(getattr(mlp, field), getattr(mlp, f"{field}_lora"))
        mlp = eqx.tree_at(lambda m, f=field: getattr(m, f), mlp, merged)
    return drop_experts(mlp)


def drop_experts(mlp: MoeMlp) -> MoeMlp:
    """``mlp`` without its expert adapters: the base layer."""
    return eqx.tree_at(
        lambda m: (m.gate_lora, m.up_lora, m.down_lora),
        mlp,
        (None, None, None),
        is_leaf=lambda x: x is None,
    )


def expert_adapters(model: Any) -> dict[str, ExpertAdapter]:
    """``{dotted name: adapter}`` of every expert adapter in ``model`` (``<layer>.gate_lora``)."""
    found: dict[str, ExpertAdapter] = {}

    def visit(path, node):
        if is_moe(node):
            for field in EXPERT_WEIGHTS:
                adapter = getattr(node, f"{field}_lora")
                if adapter is not None:
                    found[f"{path_name(path, '.')}.{field}_lora"] = adapter
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=is_moe)
    return found
