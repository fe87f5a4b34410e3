"""Which parameters get weight decay: linear weights by default, or those matching regexes."""

from __future__ import annotations

import re
from collections.abc import Sequence

import equinox as eqx
import haliax.nn as hnn
import jax

from loomax.tree_paths import is_named_array, named_leaves, path_name


def weight_decay_mask(model: eqx.Module, *, decay_embeddings: bool = False):
    """A pytree prefix of ``model`` with bools: True where weight decay applies.

    Linear weights decay; biases, norm scales and (unless ``decay_embeddings``) embedding
    tables do not. ``Stacked`` layers hold ordinary modules, so this sees through them.
    """

    def mark(node):
        falses = jax.tree.map(lambda _: False, node)
        if isinstance(node, hnn.Linear) and node.weight is not None:  # QLoRA's: codes, frozen
            return eqx.tree_at(lambda m: m.weight, falses, True)
        if isinstance(node, hnn.Embedding):
            return eqx.tree_at(lambda m: m.weight, falses, decay_embeddings)
        return falses

    return jax.tree.map(mark, model, is_leaf=lambda x: isinstance(x, hnn.Linear | hnn.Embedding))


def regex_mask(model: eqx.Module, patterns: str | Sequence[str]):
    """True for every parameter whose dotted name (e.g. ``blocks.stacked.attn.qkv.weight``)
    matches (``re.search``) one of ``patterns``."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    try:
        compiled = [re.compile(p) for p in patterns]
    except re.error as e:
        raise ValueError(f"optimizer.weight_decay_modules: bad regex ({e})") from e

    def mark(path, leaf):
        hit = any(c.search(path_name(path, ".")) for c in compiled)
        return jax.tree.map(lambda _: hit, leaf)

    return jax.tree_util.tree_map_with_path(mark, model, is_leaf=is_named_array)


def parameter_names(model: eqx.Module) -> list[str]:
    """Dotted names of the model's parameters (what ``weight_decay_modules`` matches)."""
    return [name for name, _ in named_leaves(eqx.filter(model, eqx.is_inexact_array), ".")]
