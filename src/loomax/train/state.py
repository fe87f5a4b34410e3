"""TrainerState: everything a training run carries from one step to the next."""

from __future__ import annotations

import equinox as eqx
import jax
import optax


class TrainerState(eqx.Module):
    """The step counter, the model, the optimizer state and the PRNG key.

    This is what the train step maps to its successor and what checkpoints save.
    """

    step: jax.Array
    model: eqx.Module
    opt_state: optax.OptState
    key: jax.Array
