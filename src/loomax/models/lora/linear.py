"""``LoraLinear``: a ``haliax.nn.Linear`` plus a low-rank adapter, and the model surgery.

The adapter of a layer with input axes ``In`` and output axes ``Out`` is ``lora_a``
(``lora_r`` x In) and ``lora_b`` (Out x ``lora_r``), both with the weight's other axes
in front (``layers`` in a stack of blocks), so that a scanned stack slices them per layer
as it slices the weight. The output is ``W x + scale * B (A dropout(x))``, ``scale =
alpha / rank``; B starts at zero, so a model with fresh adapters computes the base model's
outputs exactly. Being a ``Linear``, the layer keeps its parameter names (``...q_proj.weight``)
and everything that reads linear layers (weight decay, FP8, offload) sees it as before;
its adapter's arrays are named ``...q_proj.lora_a`` / ``.lora_b`` and carry named axes, so
FSDP and tensor parallelism shard them by the same axis mappings as the weight (``lora_r``
is never sharded). With ``model.lora.quantize_base`` (QLoRA) the frozen weight is kept as
blockwise codes and scales (``quantized``; ``weight`` is None) and dequantised per matmul.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from loomax.config import ConfigError
from loomax.models.blocks.dropout import dropout
from loomax.models.lora import dora, experts
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.quantized import BlockQuantized, quantize
from loomax.models.moe.expert_adapter import ExpertAdapter
from loomax.tree_paths import path_name

RANK = "lora_r"
"""The adapters' rank axis."""


class LoraLinear(hnn.Linear):
    """A linear layer with a low-rank adapter (module docstring)."""

    lora_a: NamedArray | None = None
    lora_b: NamedArray | None = None
    scale: float = eqx.field(static=True, default=1.0)
    dropout_rate: float = eqx.field(static=True, default=0.0)
    quantized: BlockQuantized | None = None  # QLoRA: the frozen weight (``weight`` is None)
    lora_m: NamedArray | None = None  # DoRA: magnitude - ||W|| per output unit (``dora``)

    def __call__(self, inputs: NamedArray, *, key=None) -> NamedArray:
        x = dropout(inputs, self.dropout_rate, key)
        low = x.dot(self.lora_a.astype(x.dtype), axis=self.In)
        delta = low.dot(self.lora_b.astype(x.dtype), axis=RANK)
        delta = delta * jnp.asarray(self.scale, delta.dtype)
        if self.lora_m is not None:  # DoRA: the magnitude times the adapted direction
            weight = self.base_weight(inputs.dtype if self.quantized is not None else None)
            plain = hnn.Linear(weight, None, self.In, self.Out, self.dot_general,
                               self._reparam_cls)  # fmt: skip
            out = plain(inputs)
            more = self.dora_excess().astype(out.dtype)  # ratio - 1: 0 at the first step
            # PEFT's form: W x + (ratio - 1) W x + ratio * delta, W x itself at ratio 1
            out = out + (more * out + (1 + more) * delta.astype(out.dtype))
            if self.bias is not None:
                out = out + self.bias.astype(out.dtype)
            return hax.auto_sharded(out)
        if self.quantized is None:
            out = super().__call__(inputs)
        else:  # dequantised for this matmul, in the compute dtype
            out = self.base(inputs.dtype)(inputs)
        return hax.auto_sharded(out + delta.astype(out.dtype))

    def adapted_weight(self) -> NamedArray:
        """``W + scale * B A`` in float32, laid out as the weight."""
        return self.base_weight(jnp.float32) + self.delta().astype(jnp.float32)

    def dora_excess(self) -> NamedArray:
        """DoRA's ``m / ||W + scale * B A|| - 1`` per output unit (float32; ``dora``)."""
        base = self.base_weight(jnp.float32)
        return dora.excess(self.lora_m, base, self.delta(), self.In)

    def magnitude(self) -> NamedArray:
        """DoRA's magnitude ``m`` per output unit (float32): ``||W|| + lora_m``."""
        return dora.magnitude(self.lora_m, self.base_weight(jnp.float32), self.In)

    def delta(self) -> NamedArray:
        """``scale * B A`` laid out as the weight (what merging adds to it)."""
        product = self.lora_b.dot(self.lora_a, axis=RANK) * self.scale
        weight = self.base_weight()
        return (product / self.reparam.active_scale).rearrange(weight.axes)

    def base_weight(self, dtype=None) -> NamedArray:
        """The base weight: ``weight``, or with QLoRA its dequantised codes (``dtype``, else
        float32)."""
        if self.quantized is None:
            return self.weight if dtype is None else self.weight.astype(dtype)
        return self.quantized.dequantize(dtype or jnp.float32)

    def merged(self) -> hnn.Linear:
        """The plain ``Linear`` computing what this layer computes: W + scale * B A (DoRA:
        that times ``m / ||W + scale * B A||`` per output unit)."""
        base = self.base_weight()
        weight = (base + self.delta()).astype(base.dtype)
        if self.lora_m is not None:
            weight = self.adapted_weight() * (1 + self.dora_excess())
            weight = weight.rearrange(base.axes).astype(base.dtype)
        return hnn.Linear(weight, self.bias, self.In, self.Out, self.dot_general, self._reparam_cls)

    def base(self, dtype=None) -> hnn.Linear:
        """The layer without its adapter (QLoRA: the dequantised weight)."""
        return hnn.Linear(
            self.base_weight(dtype), self.bias, self.In, self.Out, self.dot_general,
            self._reparam_cls,
        )  # fmt: skip


def _axes(spec) -> tuple[Axis, ...]:
    return (spec,) if isinstance(spec, Axis) else tuple(spec)


def _is_linear(x: Any) -> bool:
    return isinstance(x, hnn.Linear)


def linear_names(model: Any) -> list[str]:
    """The dotted names of ``model``'s linear layers (what ``model.lora.targets`` matches)."""
    names: list[str] = []

    def visit(path, node):
        if _is_linear(node):
            names.append(path_name(path, "."))
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=_is_linear)
    return names


def add_adapter(linear: hnn.Linear, config: LoraConfig, key: jax.Array) -> LoraLinear:
    """``linear`` with a fresh adapter: A ~ N(0, 1/fan_in), B = 0."""
    ins, outs = _axes(linear.In), _axes(linear.Out)
    own = {a.name for a in ins + outs}
    front = tuple(a for a in linear.weight.axes if a.name not in own)  # layers (experts)
    rank = Axis(RANK, config.rank)
    fan_in = 1
    for a in ins:
        fan_in *= a.size
    dtype = linear.weight.dtype
    a = hax.random.normal(key, (*front, rank, *ins)) * (fan_in**-0.5)
    b = hax.zeros((*front, *outs, rank), dtype=dtype)
    fields = {f.name: getattr(linear, f.name) for f in dataclasses.fields(hnn.Linear)}
    quantized = None
    if config.quantize_base != "none":  # QLoRA: the frozen weight kept as codes and scales
        quantized = quantize(linear.weight, linear.In, config.quantize_base, config.quantize_block)
        fields["weight"] = None
    magnitude = None
    if config.dora:  # m - ||W|| per output unit: 0, so the first step is the base
        norm = dora.norm_per_output(linear.weight, linear.In)
        magnitude = hax.zeros(norm.axes, dtype=dtype)
    return LoraLinear(
        **fields,
        lora_a=a.astype(dtype),
        lora_b=b,
        scale=config.scale,
        dropout_rate=config.dropout,
        quantized=quantized,
        lora_m=magnitude,
    )


def apply_lora(model: Any, config: LoraConfig) -> Any:
    """``model`` with an adapter on every linear layer and expert weight (``experts``) whose
    dotted name matches one of ``config.targets`` (MoE routers excepted); a target matching
    none is a ``ConfigError`` naming the key."""
    names = [n for n in linear_names(model) if "router" not in n]  # routers get none
    names += experts.expert_weight_names(model)
    compiled = [re.compile(p) for p in config.targets]
    for pattern, regex in zip(config.targets, compiled, strict=True):
        if not any(regex.search(n) for n in names):
            raise ConfigError(
                f"model.lora.targets: {pattern!r} matches no linear layer or expert weight "
                f"of {type(model).__name__}; its names: {', '.join(names)}"
            )
    root = jax.random.PRNGKey(config.seed)

    def convert(path, node):
        if not _is_linear(node) or isinstance(node, LoraLinear):
            return node
        name = path_name(path, ".")
        if "router" in name or not any(r.search(name) for r in compiled):
            return node
        return add_adapter(node, config, jax.random.fold_in(root, zlib.crc32(name.encode())))

    def convert_experts(path, node):
        if not experts.is_moe(node):
            return node
        return experts.adapt_experts(node, path_name(path, "."), compiled, config, root)

    model = jax.tree_util.tree_map_with_path(convert, model, is_leaf=_is_linear)
    return jax.tree_util.tree_map_with_path(convert_experts, model, is_leaf=experts.is_moe)


def _replace(model: Any, how, how_experts) -> Any:
    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    model = jax.tree.map(lambda n: how(n) if is_lora(n) else n, model, is_leaf=is_lora)
    on_moe = lambda n: how_experts(n) if experts.is_moe(n) else n  # noqa: E731
    return jax.tree.map(on_moe, model, is_leaf=experts.is_moe)


def merge_lora(model: Any) -> Any:
    """``model`` with every adapter folded into its weight: plain ``Linear`` layers and bare
    expert weights, the same outputs (up to rounding), the layout any export reads."""
    return _replace(model, LoraLinear.merged, experts.merge_experts)


def without_adapters(model: Any) -> Any:
    """``model`` with every adapter dropped: the base model."""
    return _replace(model, LoraLinear.base, experts.drop_experts)


def adapter_layers(model: Any) -> dict[str, LoraLinear | ExpertAdapter]:
    """``{dotted name: layer}`` of every ``LoraLinear`` in ``model``, and every expert
    adapter (``<moe layer>.gate_lora``: ``models/lora/experts.py``)."""
    found: dict[str, LoraLinear | ExpertAdapter] = dict(experts.expert_adapters(model))
    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731

    def visit(path, node):
        if is_lora(node):
            found[path_name(path, ".")] = node
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=is_lora)
    return found
