"""TrainerState: everything a training run carries from one step to the next."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import optax


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
