"""Parameter names from pytree key paths: one way to name a leaf, used everywhere.

A name joins the path's keys: Equinox fields by attribute name, dict keys by key, sequence
entries by index (``blocks/stacked/attn/qkv/weight``). Checkpoints use ``/``, weight-decay
regexes ``.``. ``sep=None`` gives JAX's own key string (``.blocks.attn.weight``, ``['k']``,
``[0]``), which the weights of ``model.save`` are stored under.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import haliax as hax
import jax

__all__ = ["is_named_array", "key_name", "named_leaves", "path_name"]


def is_named_array(x: Any) -> bool:
    """True for a Haliax ``NamedArray`` (treated as one leaf when naming)."""
    return isinstance(x, hax.NamedArray)


def key_name(entry: Any) -> str:
    """One path entry as text: attribute name, dict key, sequence or flattened index."""
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path: Sequence[Any], sep: str | None = "/") -> str:
    """The name of a key path: its keys joined by ``sep`` ("" for the root), or JAX's
    ``keystr`` form when ``sep`` is None."""
    if sep is None:
        return jax.tree_util.keystr(tuple(path))
    return sep.join(key_name(entry) for entry in path)


def named_leaves(
    tree: Any, sep: str | None = "/", *, whole_named_arrays: bool = True
) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of ``tree`` in flattening order.

    With ``whole_named_arrays`` a ``NamedArray`` is one leaf (returned as is, named by its own
    path); otherwise the walk goes into it and its array is the leaf.
    """
    is_leaf = is_named_array if whole_named_arrays else None
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_name(path, sep), leaf) for path, leaf in leaves]
