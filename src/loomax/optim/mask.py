"""Which parameters get weight decay: the weights of linear layers (and optionally embeddings)."""

from __future__ import annotations

import equinox as eqx
import haliax.nn as hnn
import jax


def weight_decay_mask(model: eqx.Module, *, decay_embeddings: bool = False):
    """A pytree prefix of ``model`` with bools: True where weight decay applies.

    Linear weights decay; biases, norm scales and (unless ``decay_embeddings``) embedding
    tables do not. ``Stacked`` layers hold ordinary modules, so this sees through them.
    """

    def mark(node):
        falses = jax.tree.map(lambda _: False, node)
        if isinstance(node, hnn.Linear):
            return eqx.tree_at(lambda m: m.weight, falses, True)
        if isinstance(node, hnn.Embedding):
            return eqx.tree_at(lambda m: m.weight, falses, decay_embeddings)
        return falses

    return jax.tree.map(mark, model, is_leaf=lambda x: isinstance(x, hnn.Linear | hnn.Embedding))
