"""``trainer.model_averaging``: an average of the weights, kept in the state and evaluated.

The average is the ``ema`` hook's (``loomax.hooks.ema``); these configs say how much
weight the previous average keeps at each step (``decay(step)``, traced in the step).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import draccus
import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ModelAveragingConfig(draccus.ChoiceRegistry, abc.ABC):
    """Base of the model-averaging configs; ``type`` picks one (ema, ema_decay_sqrt)."""

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "ema"

    @abc.abstractmethod
    def decay(self, step: jax.Array) -> jax.Array:
        """Weight of the previous average after ``step`` steps (the new weights get 1 - it)."""


@ModelAveragingConfig.register_subclass("ema")
@dataclass(frozen=True)
class EmaAveraging(ModelAveragingConfig):
    """An exponential moving average: ``avg = beta * avg + (1 - beta) * weights`` at each step."""

    beta: float = 0.999
    """Weight of the previous average at each step."""

    def __post_init__(self):
        if not 0 <= self.beta < 1:
            raise ValueError(f"trainer.model_averaging.beta must be in [0, 1), got {self.beta}")

    def decay(self, step: jax.Array) -> jax.Array:
        return jnp.asarray(self.beta, jnp.float32)


@ModelAveragingConfig.register_subclass("ema_decay_sqrt")
@dataclass(frozen=True)
class EmaDecaySqrtAveraging(EmaAveraging):
    """An EMA until ``switch_step``; then the new weights' share falls as 1 - sqrt(progress)
    over ``decay_steps``, so the average settles (a cooldown of the average itself)."""

    switch_step: int = 0
    """Step from which the new weights' share decays."""
    decay_steps: int = 1000
    """Steps over which the share falls from 1 - beta to min_share."""
    min_share: float = 1e-5
    """The share left to the new weights once the decay is over."""

    def __post_init__(self):
        super().__post_init__()
        if self.switch_step < 0 or self.decay_steps < 1:
            raise ValueError(
                "trainer.model_averaging: switch_step must be >= 0 and decay_steps >= 1, "
                f"got {self.switch_step} and {self.decay_steps}"
            )
        if not 0 <= self.min_share <= 1 - self.beta:
            raise ValueError(
                f"trainer.model_averaging.min_share must be in [0, 1 - beta], got {self.min_share}"
            )

    def decay(self, step: jax.Array) -> jax.Array:
        progress = jnp.clip((step - self.switch_step) / self.decay_steps, 0.0, 1.0)
        share = (1 - self.beta) * (1 - jnp.sqrt(progress))
        return 1 - jnp.maximum(share, self.min_share).astype(jnp.float32)
