"""Evaluate the model on validation batches every N steps (and at the start and end)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jmp

from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

EvalLossFn = Callable[..., tuple[jax.Array, jax.Array]]


def make_loss_evaluator(
    loss_fn: EvalLossFn,
    batches: Sequence[Any],
    mp: jmp.Policy,
    *,
    jit: Callable[[Callable], Callable] = jax.jit,
    prepare: Callable[[Any], Any] = lambda batch: batch,
) -> Callable[[Any], dict[str, float]]:
    """``evaluate(model) -> {"eval/loss", "eval/perplexity"}``: the mean loss over ``batches``.

    ``loss_fn(model, batch, *, key)`` returns ``(loss_sum, weight)``; sums are added on the
    device and pulled to the host once. ``jit`` and ``prepare`` let the trainer run it
    sharded (``trainer.mesh_jit`` and ``trainer.shard_batch``).
    """

    def batch_loss(model, batch):
        total, weight = loss_fn(mp.cast_to_compute(model), batch, key=None)
        return jnp.asarray(total, jnp.float32), jnp.asarray(weight, jnp.float32)

    batch_loss = jit(batch_loss)
    prepared = [prepare(b) for b in batches]

    def evaluate(model) -> dict[str, float]:
        total = weight = jnp.zeros((), jnp.float32)
        for batch in prepared:
            t, w = batch_loss(model, batch)
            total, weight = total + t, weight + w
        loss = float(total / weight)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0))}

    return evaluate


class EvalHook(Hook):
    """Runs ``evaluate(model)`` every ``every`` steps, logs the result and prints the loss."""

    def __init__(
        self, evaluate: Callable[[Any], dict[str, float]], every: int, *, at_start: bool = True
    ):
        self.evaluate = evaluate
        self.every = every
        self.at_start = at_start
        self.last_step: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def on_train_begin(self, info: StepInfo) -> None:
        if self.at_start and self.last_step != info.step:  # a resumed run already has it
            self._run(info)

    def on_step(self, info: StepInfo) -> None:
        self._run(info)

    def on_train_end(self, info: StepInfo) -> None:
        if self.last_step != info.step:
            self._run(info)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "history": [[s, r] for s, r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = state["last_step"]
        self.history = [(s, r) for s, r in state["history"]]

    def _run(self, info: StepInfo) -> None:
        results = self.evaluate(info.state.model)
        info.log(results)
        self.history.append((info.step, results))
        self.last_step = info.step
        logger.info("eval at step %d: loss %.4f", info.step, results["eval/loss"])
