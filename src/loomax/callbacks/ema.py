"""EMA weights: an exponential moving average of the parameters, kept in the state.

The average lives in ``TrainerState.extras["ema"]`` (so it is sharded like the
parameters and saved in checkpoints) and is updated inside the step:
``ema = decay * ema + (1 - decay) * params``. With ``use_for_eval`` evaluators use it
(``info.eval_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax

from loomax.train.hook_config import HookConfig, HookContext
from loomax.train.hooks import Hook
from loomax.train.step import StateExtra, StepContext

EMA_KEY = "ema"


class EmaHook(Hook):
    """Keeps ``extras["ema"]``; nothing runs on the host."""

    def __init__(self, decay: float = 0.999, *, use_for_eval: bool = False):
        if not 0 <= decay < 1:
            raise ValueError(f"ema decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.provides_eval_weights = EMA_KEY if use_for_eval else None

    def state_extras(self) -> dict[str, StateExtra]:
        decay = self.decay

        def update(ema, context: StepContext):
            params = eqx.filter(context.new_model, eqx.is_inexact_array)
            return jax.tree.map(
                lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), ema, params
            )

        return {EMA_KEY: StateExtra(init=lambda params: params, update=update)}


@HookConfig.register_subclass("ema")
@dataclass(frozen=True)
class EmaConfig(HookConfig):
    """An exponential moving average of the weights, kept in the checkpointed state."""

    decay: float = 0.999
    """Weight of the previous average at each step."""
    use_for_eval: bool = False
    """Evaluate the EMA weights instead of the trained ones."""

    def __post_init__(self):
        if not 0 <= self.decay < 1:
            raise ValueError(f"trainer.hooks (ema): decay must be in [0, 1), got {self.decay}")

    def build(self, context: HookContext) -> Hook:
        return EmaHook(self.decay, use_for_eval=self.use_for_eval)
