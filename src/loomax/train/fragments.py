"""Parameters split into fragments for streaming DiLoCo: contiguous blocks of layers, with the
arrays that have no ``layers`` axis (embeddings, final norm) given to the lightest fragments.

A fragment is a tuple of ``Piece``s; a piece is one array of the parameter tree (by its index
among the tree's arrays), whole or a range of its ``layers`` axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import haliax as hax
import jax
import numpy as np

from loomax.config import ConfigError

LAYERS = "layers"


@dataclass(frozen=True)
class Piece:
    """Array ``leaf`` of the tree, rows ``start:stop`` of its ``layers`` axis (or all of it)."""

    leaf: int
    start: int = 0
    stop: int | None = None
    """None: the whole array."""


def nodes(tree: Any) -> list[Any]:
    """The arrays of ``tree`` (``NamedArray``s whole), in the order pieces index them."""
    return jax.tree.leaves(tree, is_leaf=hax.is_named_array)


def plan_fragments(params: Any, count: int) -> tuple[tuple[Piece, ...], ...]:
    """Split ``params`` (arrays or shapes) into ``count`` fragments of similar size.

    Layer ``j`` of ``L`` goes to fragment ``j * count // L`` (contiguous blocks); each array
    without a ``layers`` axis, largest first, goes to the fragment smallest so far.
    """
    if count < 1:
        raise ConfigError(f"trainer.diloco.fragments must be >= 1, got {count}")
    fragments: list[list[Piece]] = [[] for _ in range(count)]
    sizes = [0] * count
    whole = []
    for i, node in enumerate(nodes(params)):
        named = hax.is_named_array(node)
        names = [a.name for a in node.axes] if named else []
        shape = node.array.shape if named else np.shape(node)
        size = int(np.prod(shape))
        if LAYERS not in names or count == 1:
            whole.append((size, i))
            continue
        layers = shape[names.index(LAYERS)]
        owner = [j * count // layers for j in range(layers)]
        for f in sorted(set(owner)):
            rows = [j for j in range(layers) if owner[j] == f]
            fragments[f].append(Piece(i, rows[0], rows[-1] + 1))
            sizes[f] += size // layers * len(rows)
    for size, i in sorted(whole, key=lambda s: (-s[0], s[1])):
        f = sizes.index(min(sizes))
        fragments[f].append(Piece(i))
        sizes[f] += size
    empty = [f for f, pieces in enumerate(fragments) if not pieces]
    if empty:
        raise ConfigError(
            f"trainer.diloco.fragments: {count} fragments, but the model's parameters make only "
            f"{count - len(empty)} (blocks of layers and whole arrays); use fewer fragments"
        )
    return tuple(tuple(sorted(pieces, key=lambda p: (p.leaf, p.start))) for pieces in fragments)


def take(leaves: Sequence[Any], pieces: Sequence[Piece]) -> list[Any]:
    """The parts of ``leaves`` (``nodes`` of a tree, stacked or not) that ``pieces`` name."""
    out = []
    for piece in pieces:
        node = leaves[piece.leaf]
        if piece.stop is None:
            out.append(node)
            continue
        out.append(node[{LAYERS: slice(piece.start, piece.stop)}])
    return out


def put(leaves: Sequence[Any], pieces: Sequence[Piece], values: Sequence[Any]) -> list[Any]:
    """``leaves`` with the parts ``pieces`` name replaced by ``values`` (as ``take`` gives them)."""
    out = list(leaves)
    for piece, value in zip(pieces, values, strict=True):
        if piece.stop is None:
            out[piece.leaf] = value
            continue
        node = out[piece.leaf]
        axis = [a.name for a in node.axes].index(LAYERS)
        array = jax.lax.dynamic_update_slice_in_dim(node.array, value.array, piece.start, axis)
        out[piece.leaf] = hax.NamedArray(array, node.axes)
    return out


def synced_at(step: int, inner_steps: int, fragments: int) -> int | None:
    """The fragment synced at the end of step ``step`` (counted from 1), or None.

    Fragment ``f`` is synced every ``inner_steps`` steps, ``(f + 1) * inner_steps / fragments``
    steps into each period: the fragments' syncs are evenly staggered.
    """
    stride = inner_steps // fragments
    if step % stride:
        return None
    return (step // stride - 1) % fragments
