"""Model merge: the average of the weights over the last ``window`` steps before given steps.

Inside the step the weights after steps ``t - window + 1 .. t`` are summed into
``TrainerState.extras["merge"]`` (float32); after step ``t`` the host saves the average
as a checkpoint ``<run_dir>/merged/step-<t>`` holding ``model`` (loadable with
``trainer.initialize_from``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from loomax.checkpoint import Checkpointer, CheckpointerConfig
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo
from loomax.train.step import StateExtra, StepContext

logger = logging.getLogger(__name__)

MERGE_KEY = "merge"


@hook_type("model_merge")
class ModelMergeHook(Hook):
    """Averages the weights of the ``window`` steps up to each of ``steps`` and saves them
    under ``directory`` (default ``<run_dir>/merged``)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Average the weights over the last `window` steps before each of `steps`; save the merged model."""

        steps: list[int] = field(default_factory=list)
        """Steps at which a merged model is saved (each averages the `window` steps up to it)."""
        window: int = 10
        """Steps averaged."""
        directory: str | None = None
        """Where merged models go; null = <run_dir>/merged."""

        def __post_init__(self):
            self.check_positive("window")
            self.check(bool(self.steps), "steps must list at least one step")
            self.check(all(s >= 1 for s in self.steps), f"steps must be >= 1, got {self.steps}")

    config: Config
    every = 1

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path | None = None,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.directory = self.output_directory(run_dir, "merged")
        self.steps = sorted(set(self.config.steps))
        """The steps saved at, sorted."""
        self.saved: list[int] = []
        self._saver: Checkpointer | None = None

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir)

    def state_extras(self) -> dict[str, StateExtra]:
        targets = jnp.asarray(self.steps)
        starts = jnp.maximum(targets - self.config.window + 1, 1)

        def update(total, context: StepContext):
            done = context.step + 1  # the step just taken, counted from 1
            params = eqx.filter(context.new_model, eqx.is_inexact_array)
            restart = jnp.any(done == starts)
            inside = jnp.any((done >= starts) & (done <= targets))
            return jax.tree.map(
                lambda t, p: jnp.where(restart, p.astype(t.dtype), jnp.where(inside, t + p, t)),
                total,
                params,
            )

        def init(params):
            return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        return {MERGE_KEY: StateExtra(init=init, update=update)}

    def on_step(self, info: StepInfo) -> None:
        if info.step not in self.steps:
            return
        count = min(self.config.window, info.step)
        total = info.state.extras[MERGE_KEY]
        model = eqx.filter(info.state.model, eqx.is_inexact_array)
        averaged = jax.tree.map(lambda t, p: (t / count).astype(p.dtype), total, model)
        merged = eqx.combine(
            averaged, eqx.filter(info.state.model, eqx.is_inexact_array, inverse=True)
        )
        if self._saver is None:
            config = CheckpointerConfig(save_interval=None, keep=[])
            self._saver = Checkpointer(config, str(self.directory))
        self._saver.save(
            info.step, {"model": merged}, {"merged_steps": count}, permanent=True, block=True
        )
        self.saved.append(info.step)
        info.log({"merge/saved_step": info.step})
        logger.info(
            "saved the average of steps %d-%d to %s",
            info.step - count + 1,
            info.step,
            self.directory,
        )
