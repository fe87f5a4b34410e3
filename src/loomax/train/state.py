"""TrainerState: everything a training run carries from one step to the next."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import optax

from loomax.models.axes import Layers
from loomax.runtime import MeshRuntime

HOST = "pinned_host"
"""The memory kind offloaded state rests in."""


class TrainerState(eqx.Module):
    """The step counter, the model, the optimizer state, the PRNG key and hook extras.

    This is what the train step maps to its successor and what checkpoints save.
    ``extras`` holds arrays that hooks keep in the step (``StateExtra``: EMA weights,
    a model-merge accumulator), by name; it is empty unless a hook asks for one.
    """

    step: jax.Array
    model: eqx.Module
    opt_state: optax.OptState
    key: jax.Array
    extras: dict[str, Any] = eqx.field(default_factory=dict)


def state_shardings(
    runtime: MeshRuntime,
    state: TrainerState,
    *,
    offload_optimizer_state: bool = False,
    offload_params: bool = False,
) -> TrainerState:
    """Shardings of ``state`` (or its shapes): the optimizer state by the optimizer mapping
    (split even where parameters are kept whole, for ZeRO-2), in pinned host memory if
    ``offload_optimizer_state``; the rest by the parameter mapping, the model's arrays with
    a ``layers`` axis (the stacked blocks) in pinned host memory if ``offload_params``."""
    shardings = runtime.state_shardings(state)
    if offload_params:
        model = layers_on_host(shardings.model, state.model)
        shardings = TrainerState(
            shardings.step, model, shardings.opt_state, shardings.key, shardings.extras
        )
    if not runtime.mappings.zero2 and not offload_optimizer_state:
        return shardings
    opt = runtime.state_shardings(state.opt_state, runtime.mappings.optimizer)
    if offload_optimizer_state:
        opt = jax.tree.map(lambda s: s.with_memory_kind(HOST), opt)
    return TrainerState(shardings.step, shardings.model, opt, shardings.key, shardings.extras)


def layers_on_host(shardings: Any, model: Any) -> Any:
    """``shardings`` (of ``model``) with those of the arrays that have a ``layers`` axis
    moved to pinned host memory; the rest (embeddings, final norm) stay on the devices."""

    def place(node: Any, sharding: Any) -> Any:
        if isinstance(node, hax.NamedArray) and Layers in {a.name for a in node.axes}:
            return jax.tree.map(lambda s: s.with_memory_kind(HOST), sharding)
        return sharding

    is_leaf = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    return jax.tree.map(place, model, shardings, is_leaf=is_leaf)
