"""Name-by-name tables between Loomax parameters and Hugging Face tensors.

A ``Param`` says where a weight lives in the Loomax model and how its named axes lie in
the HF tensor: ``dims`` lists the HF dimensions in order, each one axis name or a tuple of
names flattened together (head-major, as HF lays out ``q_proj`` and GPT-2's ``c_attn``).
Per-layer weights have ``{i}`` in their HF name and the ``layers`` axis in Loomax;
per-expert weights (a mixture of experts) also ``{e}`` and the ``experts`` axis. A weight
that is one part of a fused HF tensor (Phi 3's ``qkv_proj``) names the rows it fills
(``rows``); export stacks the parts of one tensor in the order listed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from loomax.errors import BadFileError
from loomax.models.axes import Experts, Layers

Dims = tuple[str | tuple[str, ...], ...]


@dataclass(frozen=True)
class Param:
    hf_name: str
    where: Callable  # model -> NamedArray
    dims: Dims
    rows: tuple[int, int] | None = None
    """``(start, stop)`` along the HF tensor's first dimension: this weight is that part of it."""
    first_layer: int = 0
    """HF's layer number ``{i}`` of this stack's first block (a stack after dense first layers)."""

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf_name

    def _stacked(self) -> tuple[str, ...]:
        """The Loomax axes that HF splits into separate tensors (by ``{i}``, ``{e}``)."""
        return ((Layers,) if self.per_layer else ()) + ((Experts,) if self.per_expert else ())

    def _names(self, named) -> list[tuple[tuple[int, ...], str]]:
        """``(index into the stacked axes, HF name)`` of every tensor of this weight."""
        sizes = [named.resolve_axis(a).size for a in self._stacked()]
        keys = ("i", "e") if self.per_layer else ("e",)

        def name(index: tuple[int, ...]) -> str:
            numbers = list(index)
            if self.per_layer:
                numbers[0] += self.first_layer
            return self.hf_name.format(**dict(zip(keys, numbers, strict=False)))

        return [(index, name(index)) for index in np.ndindex(*sizes)]

    def _order(self) -> tuple[str, ...]:
        return tuple(n for d in self.dims for n in ((d,) if isinstance(d, str) else d))

    def export(self, model) -> dict[str, np.ndarray]:
        """The HF tensor(s) of this weight (one per layer and expert for stacked weights)."""
        named = self.where(model)
        order = self._stacked() + self._order()
        array = np.asarray(jax.device_get(named.rearrange(order).array))
        shape = [
            named.resolve_axis(d).size
            if isinstance(d, str)
            else math.prod(named.resolve_axis(n).size for n in d)
            for d in self.dims
        ]
        return {name: array[index].reshape(shape) for index, name in self._names(named)}

    def load(self, skeleton, tensors: dict[str, np.ndarray]) -> hax.NamedArray:
        """This weight rebuilt from HF ``tensors``, with the skeleton leaf's axes and dtype."""
        like = self.where(skeleton)
        order = self._stacked() + self._order()
        array = np.stack([self._take(tensors, name) for _, name in self._names(like)])
        axes = tuple(like.resolve_axis(name) for name in order)
        want = tuple(a.size for a in axes)
        if math.prod(array.shape) != math.prod(want):
            raise BadFileError(
                f"HF tensor {self.hf_name} has shape {array.shape[1:]}; expected {want} flattened"
            )
        named = hax.named(jax.numpy.asarray(array.reshape(want), like.dtype), axes)
        return named.rearrange(like.axes)

    def _take(self, tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
        if name not in tensors:
            raise BadFileError(f"the HF checkpoint lacks the tensor {name!r}")
        return tensors[name] if self.rows is None else tensors[name][slice(*self.rows)]


def export_tensors(model, params: list[Param]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    parts: dict[str, list[np.ndarray]] = {}
    for p in params:
        for name, array in p.export(model).items():
            if p.rows is None:
                out[name] = array
            else:  # one part of a fused tensor: its rows, stacked below the earlier parts
                parts.setdefault(name, []).append(array)
                out[name] = None  # keeps the tensor's place in the order
    for name, arrays in parts.items():
        out[name] = np.concatenate(arrays, axis=0)
    return out


def load_tensors(skeleton, params: list[Param], tensors: dict[str, np.ndarray]):
    """``skeleton`` (from ``jax.eval_shape``) with every listed weight filled from ``tensors``."""
    model = skeleton
    for p in params:
        model = eqx.tree_at(p.where, model, p.load(skeleton, tensors))
    return model
