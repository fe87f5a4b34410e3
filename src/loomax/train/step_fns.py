"""The trainer's jitted step: built once per number of microbatches, traced, compiled, run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from loomax.mesh import replicated
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step


class JittedSteps:
    """The ``Trainer``'s step functions (a base class: it uses the trainer's ``loss_fn``,
    ``optimizer``, ``config``, ``lr_schedule``, ``hook_set``, ``runtime``,
    ``num_microbatches`` and its cache ``_step_fns``)."""

    def trace_step(
        self, state: TrainerState, batch: Any, *, num_microbatches: int | None = None
    ) -> jax.stages.Traced:
        """The jitted step traced for ``state`` and a global ``batch`` (arrays, or
        ``ShapeDtypeStruct``s with shardings): ``.jaxpr``, ``.lower().compile()``."""
        step_fn = self._build_step(state, num_microbatches)
        with self.runtime.mesh_context():
            return step_fn.jitted.trace(state, batch)

    def _build_step(self, state: TrainerState, num_microbatches: int | None = None) -> Callable:
        microbatches = num_microbatches or self.num_microbatches
        if microbatches not in self._step_fns:
            step = make_train_step(
                self.loss_fn,
                self.optimizer,
                mp=self.config.policy,
                num_microbatches=microbatches,
                lr_schedule=self.lr_schedule,
                jit_hooks=self.hook_set.jit_hooks,
                extras=self.hook_set.extras,
                freeze=self.config.freeze,
            )
            shardings = self.runtime.state_shardings(state)
            out = (shardings, replicated(self.runtime.mesh))
            self._step_fns[microbatches] = self.runtime.jit(
                step, out_shardings=out, donate_argnums=0
            )
        return self._step_fns[microbatches]

    def train_step(
        self, state: TrainerState, batch: Any, *, num_microbatches: int | None = None
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        """Run the jitted pure step (compiled on first use); ``state`` is donated.

        ``batch`` is this process's rows (numpy) or an already global ``jax.Array``.
        ``num_microbatches`` defaults to that of the first batch size.
        """
        step_fn = self._build_step(state, num_microbatches)
        if not isinstance(batch, jax.Array):
            batch = self.runtime.shard_batch(batch)
        return step_fn(state, batch)

    def compiled_step(self, state: TrainerState, batch: Any):
        """The step compiled ahead of time for these shapes; call it with ``runtime.shard_batch(batch)``."""
        step_fn = self._build_step(state)
        with self.runtime.mesh_context():
            return step_fn.jitted.lower(state, self.runtime.shard_batch(batch)).compile()

    def compilations(self) -> int:
        """How many step variants have been compiled (one per shape and batch size)."""
        return sum(fn.jitted._cache_size() for fn in self._step_fns.values())
