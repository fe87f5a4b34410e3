"""Shardings fitted to the arrays they place: a dimension that does not split evenly is kept whole."""

from __future__ import annotations

from typing import Any

import haliax as hax
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def _targets(target) -> tuple:
    if target is None:
        return ()
    return target if isinstance(target, tuple) else (target,)


def replicate_indivisible(shardings: Any, tree: Any) -> tuple[Any, list[str]]:
    """``shardings`` with every array dimension that does not split evenly over its mesh axes
    kept whole, and a note per (logical axis, size, mesh axes) that fell back.

    A mapping names logical axes, not sizes, so e.g. ``kv_heads -> model`` is right for a
    grouped-query model with 8 KV heads on a model axis of 8 and impossible with 1 KV head:
    the axis is then replicated for that array instead of failing to place it.
    """
    notes: dict[str, None] = {}

    def fit(sharding, node):
        if not isinstance(sharding, NamedSharding):
            return sharding
        names = [a.name for a in node.axes] if isinstance(node, hax.NamedArray) else None
        shape = node.array.shape if isinstance(node, hax.NamedArray) else node.shape
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        for i, entry in enumerate(spec):
            ways = int(np.prod([sharding.mesh.shape[a] for a in _targets(entry)]))
            if entry is not None and shape[i] % ways:
                label = repr(names[i]) if names else f"dimension {i}"
                notes[f"{label} (size {shape[i]}) does not split {ways} ways over {entry}"] = None
                spec[i] = None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))

    fitted = jax.tree.map(fit, shardings, tree, is_leaf=_is_sharding_or_none)
    return fitted, list(notes)


def _is_sharding_or_none(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)
