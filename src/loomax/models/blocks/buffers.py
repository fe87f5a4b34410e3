"""Buffers: arrays a model holds that training updates outside the optimizer.

A ``Buffer`` wraps a leaf of the model that is not a parameter: the train step takes no
gradient of it, the optimizer neither sees it (no state, no weight decay) nor updates it,
and it is saved in checkpoints with the rest of the model. It changes only through the
model's ``update_state(stats)``: the step calls it after the optimizer update with the
*state statistics* of the step's batch, which the model returns in
``AuxOutputs.state`` (averaged over tokens and microbatches like the loss, so a split
batch updates what the whole would). Example: the MoE router bias of aux-loss-free load
balancing (``model.moe.bias_update_rate``), moved after each step from that step's load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

STATE_PREFIX = "state/"
"""Prefix of a loss function's metrics that are state statistics (not reported)."""


class Buffer(eqx.Module):
    """A non-trainable array (or named array) of a model."""

    value: Any


def is_buffer(x: Any) -> bool:
    return isinstance(x, Buffer)


def buffer_mask(model: Any) -> Any:
    """A pytree of bools like ``model``'s leaves: True for the leaves inside a ``Buffer``."""
    return jax.tree.map(
        lambda x: jax.tree.map(lambda _: True, x) if is_buffer(x) else False,
        model,
        is_leaf=is_buffer,
    )


def has_buffers(model: Any) -> bool:
    return any(is_buffer(x) for x in jax.tree.leaves(model, is_leaf=is_buffer))


def without_buffers(tree: Any) -> Any:
    """``tree`` with each ``Buffer`` replaced by None (what the optimizer and gradients see)."""
    return jax.tree.map(lambda x: None if is_buffer(x) else x, tree, is_leaf=is_buffer)


def update_state(model: Any, stats: Mapping[str, jax.Array]) -> Any:
    """``model`` after its buffers' update from ``stats`` (itself when there are none)."""
    update = getattr(model, "update_state", None)
    if not stats or update is None:
        return model
    return update(dict(stats))


def split_state(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A loss function's metric values as ``(metrics, state statistics without the prefix)``."""
    metrics = {k: v for k, v in values.items() if not k.startswith(STATE_PREFIX)}
    state = {k[len(STATE_PREFIX) :]: v for k, v in values.items() if k.startswith(STATE_PREFIX)}
    return metrics, state
