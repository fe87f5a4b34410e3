"""Which parameters Muon treats as matrices, how each is viewed as a stack of matrices, and
the optax transform that orthogonalises them (``newton_schulz.orthogonalize_stacks``).

Muon matrices: every ``Linear`` weight (its ``Out`` x ``In`` axes the matrix) but the LM
head's, and the experts' bare weights of a mixture of experts (an array carrying the
``experts`` axis and exactly two other axes besides the batch axes). Embeddings, norms,
biases, the LM head and anything else get Adam, as Moonlight and Kimi K2 do. The batch axes
(``layers`` of stacked blocks, ``experts``) index a stack of matrices; they are never part
of one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import optax

from loomax.optim.newton_schulz import orthogonalize_stacks
from loomax.tree_paths import is_named_array

BATCH_AXES = ("layers", "experts")
"""The default batch axes: stacked layers and a mixture's experts (``models/axes.py``)."""
EXPERTS = "experts"
"""The axis that marks a bare array as the experts' stacked weights."""
HEAD_NAMES = ("lm_head",)
"""Attributes holding an LM head: a Linear of that name gets Adam (as embeddings do)."""


def _names(axes) -> tuple[str, ...]:
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(a.name if isinstance(a, hax.Axis) else a for a in axes)


def _is_node(x) -> bool:
    return isinstance(x, hnn.Linear) or is_named_array(x)


def _expert_matrix(x, batch_axes: Sequence[str]) -> tuple[str, str] | None:
    """The two matrix axes of a bare experts' weight, or None for any other array."""
    if not is_named_array(x):
        return None
    names = [a.name for a in x.axes]
    rest = tuple(n for n in names if n not in batch_axes)
    return rest if EXPERTS in names and len(rest) == 2 else None  # type: ignore[return-value]


def muon_labels(params, batch_axes: Sequence[str] = BATCH_AXES):
    """``"muon"`` for the matrices (see the module docstring), ``"adam"`` for the rest.

    Labels sit at whole NamedArrays, so masked-out parameters leave no leaf in the state.
    """

    def mark(path, node):
        labels = jax.tree.map(lambda _: "adam", node, is_leaf=is_named_array)
        if isinstance(node, hnn.Linear):
            head = bool(path) and getattr(path[-1], "name", None) in HEAD_NAMES
            return labels if head else eqx.tree_at(lambda m: m.weight, labels, "muon")
        return "muon" if _expert_matrix(node, batch_axes) else labels

    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=_is_node)


def _matrix_view(node, batch_axes) -> tuple[hax.NamedArray, tuple[str, ...], tuple[str, ...]]:
    """(the array, its row axes, its column axes) for a Muon node (Linear or bare array)."""
    if isinstance(node, hnn.Linear):
        return node.weight, _names(node.Out), _names(node.In)
    rows, cols = _expert_matrix(node, batch_axes)  # type: ignore[misc]
    return node, (rows,), (cols,)


def orthogonalize_matrices(
    steps: int = 5,
    *,
    update_rms: float = 0.2,
    batch_axes: Sequence[str] = BATCH_AXES,
    split: bool = True,
) -> optax.GradientTransformation:
    """Replace each matrix update by its orthogonalisation, scaled by
    ``update_rms * sqrt(max(rows, cols))`` (Moonlight's rule: 0.2 matches AdamW's update
    RMS), with ``rows`` and ``cols`` the matrix's full logical sizes however it is sharded.

    Axes that are neither rows nor columns (``layers``, ``experts``) are batch dims. With
    ``split`` the matrices are split over the devices, whole (``newton_schulz``). Leaves
    that are not Muon matrices pass through unchanged.
    """

    def update(updates, state, params=None):
        nodes, treedef = jax.tree.flatten(updates, is_leaf=_is_node)
        picked, stacks, names, layouts = [], [], [], []
        for i, node in enumerate(nodes):
            if isinstance(node, hnn.Linear) and not is_named_array(node.weight):
                continue  # a Linear whose weight is another transform's (masked)
            if not isinstance(node, hnn.Linear) and not _expert_matrix(node, batch_axes):
                continue
            w, rows, cols = _matrix_view(node, batch_axes)
            batch = tuple(a.name for a in w.axes if a.name not in rows + cols)
            w = w.rearrange((*batch, *rows, *cols))
            nb = len(batch)
            m = math.prod(w.array.shape[nb : nb + len(rows)])
            n = math.prod(w.array.shape[nb + len(rows) :])
            picked.append(i)
            stacks.append(w.array.reshape(*w.array.shape[:nb], m, n))
            names.append(batch)
            layouts.append((w, m, n))
        ortho = orthogonalize_stacks(stacks, steps, split=split, batch_names=names)
        nodes = list(nodes)
        for i, o, (w, m, n) in zip(picked, ortho, layouts, strict=True):
            scaled = (o * (update_rms * max(m, n) ** 0.5)).astype(w.dtype)
            named = hax.NamedArray(scaled.reshape(w.array.shape), w.axes)
            node = nodes[i]
            if isinstance(node, hnn.Linear):
                nodes[i] = eqx.tree_at(lambda x: x.weight, node, named.rearrange(node.weight.axes))
            else:
                nodes[i] = named.rearrange(node.axes)
        return jax.tree.unflatten(treedef, nodes), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
