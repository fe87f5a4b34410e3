"""EMA weights: an exponential moving average of the parameters, kept in the state.

The average lives in ``TrainerState.extras["ema"]`` (so it is sharded like the
parameters and saved in checkpoints) and is updated inside the step:
``ema = decay * ema + (1 - decay) * params``. With ``use_for_eval`` evaluators use it
(``info.eval_model``). ``trainer.model_averaging`` adds this hook with a per-step
``averaging`` schedule (``loomax.train.averaging``), evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax

from loomax.train.averaging import ModelAveragingConfig
from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook
from loomax.train.step import StateExtra, StepContext

EMA_KEY = "ema"


@hook_type("ema")
class EmaHook(Hook):
    """Keeps ``extras["ema"]``; nothing runs on the host."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """An exponential moving average of the weights, kept in the checkpointed state."""

        decay: float = 0.999
        """Weight of the previous average at each step."""
        use_for_eval: bool = False
        """Evaluate the EMA weights instead of the trained ones."""
        averaging: ModelAveragingConfig | None = None
        """A per-step decay instead of `decay` (what trainer.model_averaging sets); null = the constant decay."""

        def __post_init__(self):
            self.check(0 <= self.decay < 1, f"decay must be in [0, 1), got {self.decay}")

        @classmethod
        def of_run(cls, averaging: ModelAveragingConfig) -> EmaHook.Config:
            """The hook ``trainer.model_averaging`` adds: that average, used for evaluation."""
            return cls(use_for_eval=True, averaging=averaging)

    config: Config

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        self.provides_eval_weights = EMA_KEY if self.config.use_for_eval else None

    def state_extras(self) -> dict[str, StateExtra]:
        averaging = self.config.averaging
        constant = self.config.decay

        def update(ema, context: StepContext):
            decay = constant if averaging is None else averaging.decay(context.step)
            params = eqx.filter(context.new_model, eqx.is_inexact_array)
            return jax.tree.map(
                lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), ema, params
            )

        return {EMA_KEY: StateExtra(init=lambda params: params, update=update)}
