"""Evaluation: loss, perplexity and bits per byte on validation sets every N steps.

``make_loss_evaluator`` builds ``evaluate(model) -> metrics`` and works without a
Trainer (``loomax eval --checkpoint`` uses it); ``EvalHook`` runs it on a cadence.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from loomax.errors import DataSourceError
from loomax.models.blocks.buffers import split_state
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo
from loomax.train.loss_metrics import add_sums, metric_values, split_loss, zero_sums

if TYPE_CHECKING:
    from loomax.train.config import TrainerConfig

logger = logging.getLogger(__name__)

EvalLossFn = Callable[..., Any]
Evaluator = Callable[[Any], dict[str, float]]


def make_loss_evaluator(
    loss_fn: EvalLossFn,
    batches: Sequence[Any] | Mapping[str, Sequence[Any]],
    mp: jmp.Policy,
    *,
    jit: Callable[[Callable], Callable] = jax.jit,
    prepare: Callable[[Any], Any] = lambda batch: batch,
    count_bytes: Callable[[Any], jax.Array] | None = None,
    microbatch_rows: int | None = None,
) -> Evaluator:
    """``evaluate(model) -> {"eval/loss", "eval/perplexity", "eval/bpb"...}`` over validation batches.

    ``batches`` is one list of batches or ``{name: batches}``. With named sets each gets
    ``eval/<name>/loss``, ``/perplexity`` (and ``/bpb``), and ``eval/loss``,
    ``eval/perplexity``, ``eval/bpb`` are the macro averages over the sets (each set
    counts once, whatever its size). ``loss_fn(model, batch, *, key)`` returns
    ``(loss_sum, weight)`` in nats, or ``((loss_sum, weight), metrics)``: each metric is
    reported beside the loss (``eval/<name>``), reduced over batches and microbatches as
    ``loomax.train.loss_metrics`` says; ``count_bytes(batch)`` (traced) returns the UTF-8
    bytes of the predicted tokens, which gives bits per byte. Sums are added on the
    device and pulled to the host once per set. ``jit`` and ``prepare`` let a trainer run
    it sharded (``runtime.jit`` and ``runtime.shard_batch``).

    Batches stay on the host: each is ``prepare``d (placed on the devices) only when it is
    evaluated, so device memory holds one eval batch at a time. With ``microbatch_rows``,
    a batch of more rows (as the jitted function sees it, over all devices) is split into
    microbatches of that many rows, summed by a ``scan``, so activation memory is that of
    one microbatch; the rows must divide the batch.
    """
    named = dict(batches) if isinstance(batches, Mapping) else None
    sets = named if named is not None else {"": batches}
    for name, set_batches in sets.items():
        if len(set_batches) == 0:
            raise DataSourceError(f"validation set {name or 'validation'!r} has no batches")

    if microbatch_rows is not None and microbatch_rows < 1:
        raise ValueError(f"microbatch_rows must be >= 1 or None, got {microbatch_rows}")

    def sums_of(model, batch):
        total, weight, sums = split_loss(loss_fn(model, batch, key=None))
        nbytes = count_bytes(batch) if count_bytes is not None else 0.0
        three = [jnp.asarray(x, jnp.float32) for x in (total, weight, nbytes)]
        return jnp.stack(three), sums

    def batch_sums(model, batch):
        model = mp.cast_to_compute(model)
        rows = jax.tree.leaves(batch)[0].shape[0]
        if microbatch_rows is None or rows <= microbatch_rows:
            return sums_of(model, batch)
        if rows % microbatch_rows:
            raise ValueError(
                f"eval microbatches of {microbatch_rows} rows do not divide a batch of {rows}"
            )
        n = rows // microbatch_rows
        # microbatch i = rows i, i + n, ...: each device's rows hold an equal share of each
        micro = jax.tree.map(lambda x: x.reshape(-1, n, *x.shape[1:]).swapaxes(0, 1), batch)
        shapes = jax.eval_shape(sums_of, model, jax.tree.map(lambda x: x[0], micro))

        def body(carry, mb):
            return add_sums(carry, sums_of(model, mb)), None

        total, _ = jax.lax.scan(body, zero_sums(shapes), micro)
        return total

    batch_sums = jit(batch_sums)

    def evaluate(model) -> dict[str, float]:
        out: dict[str, float] = {}
        per_set = []
        for name, set_batches in sets.items():
            sums = None
            for batch in set_batches:  # placed on the devices one at a time
                new = batch_sums(model, prepare(batch))
                sums = new if sums is None else add_sums(sums, new)
            three, loss_sums = jax.device_get(sums)
            total, weight, nbytes = (float(x) for x in three)
            metrics = _metrics(total, weight, nbytes if count_bytes is not None else None)
            reported, _ = split_state(metric_values(loss_sums))  # state statistics: not reported
            metrics.update({k: float(v) for k, v in reported.items()})
            per_set.append(metrics)
            if name:
                out.update({f"eval/{name}/{k}": v for k, v in metrics.items()})
        shared = [k for k in per_set[0] if all(k in m for m in per_set)]
        macro = {k: float(np.mean([m[k] for m in per_set])) for k in shared}
        macro["perplexity"] = math.exp(min(macro["loss"], 700.0))
        out.update({f"eval/{k}": v for k, v in macro.items()})
        return out

    return evaluate


def _metrics(total: float, weight: float, nbytes: float | None) -> dict[str, float]:
    loss = total / weight
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    if nbytes is not None and nbytes > 0:
        metrics["bpb"] = total / (nbytes * math.log(2))
    return metrics


def token_byte_lengths(tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special and unused ids).

    Byte-level BPE tokens are strings of one character per byte; other tokenizers are
    measured by decoding each token alone.
    """
    lengths = np.zeros(vocab_size, np.int32)
    decoder = (json.loads(tokenizer.to_str()).get("decoder") or {}).get("type")
    special = set(tokenizer.get_added_tokens_decoder())
    for token_id in range(min(vocab_size, tokenizer.get_vocab_size())):
        if token_id in special:
            continue
        if decoder == "ByteLevel":
            piece = tokenizer.id_to_token(token_id)
            lengths[token_id] = len(piece) if piece is not None else 0
        else:
            lengths[token_id] = len(tokenizer.decode([token_id]).encode("utf-8"))
    return lengths


def next_token_bytes(byte_lengths: np.ndarray) -> Callable[[Any], jax.Array]:
    """``count_bytes`` for a ``[batch, position]`` token array whose next tokens are predicted."""
    table = jnp.asarray(byte_lengths)

    def count(tokens) -> jax.Array:
        return jnp.sum(table[jnp.asarray(tokens)[:, 1:]])

    return count


@hook_type("eval")
class EvalHook(Hook):
    """Asks for an evaluation every ``every`` steps and at ``steps`` (and at the start and the end, optionally).

    The trainer then calls ``run_eval``, logs the results and passes them to every hook's
    ``on_eval``. The model evaluated is ``info.eval_model`` (EMA weights if a hook asks).
    ``evaluate(model) -> metrics`` is e.g. ``make_loss_evaluator(...)``; ``name`` is the
    key its state (history) is saved under.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Another evaluation on the run's validation sets (the run's own follows trainer.steps_per_eval)."""

        every: int = 1000
        """Evaluate every this many steps."""
        steps: list[int] = field(default_factory=list)
        """Also evaluate at these steps, e.g. [100, 500]."""
        at_start: bool = False
        """Also evaluate before the first step."""
        at_end: bool = True
        """Also evaluate after the last step."""
        max_batches: int | None = None
        """Use at most this many batches of each validation set; null = all the run has."""

        def __post_init__(self):
            self.check_positive("every", "max_batches")
            self.check(
                all(isinstance(s, int) and s >= 1 for s in self.steps),
                f"steps must be steps >= 1, got {self.steps}",
            )

        @classmethod
        def of_run(cls, trainer: TrainerConfig) -> EvalHook.Config:
            """The run's own evaluation: trainer.steps_per_eval, eval_steps, eval_at_start, max_eval_batches."""
            return cls(
                every=trainer.steps_per_eval,
                steps=list(trainer.eval_steps),
                at_start=trainer.eval_at_start,
                max_batches=trainer.max_eval_batches,
            )

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        evaluate: Evaluator,
        name: str = "EvalHook",
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.evaluate = evaluate
        self.state_key = name
        self.last_step: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []
        self.steps = frozenset(self.config.steps)
        """The extra steps evaluated at (besides multiples of ``config.every``)."""
        if self.steps:
            self.every = 1  # on_step must see the listed steps too

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        """Uses the run's evaluator (``context.evaluator``) unless ``max_batches`` asks for fewer batches.

        The run's own evaluation (``Config.of_run``) keeps its state under ``EvalHook``,
        others under ``EvalHook[every=N]``.
        """
        sets = {k: v[: config.max_batches] for k, v in context.validation.items()}
        evaluate = context.evaluator
        if evaluate is None or any(len(sets[k]) < len(v) for k, v in context.validation.items()):
            evaluate = _own_evaluator(sets, context)
        trainer = context.trainer_config
        own = trainer is not None and config == cls.Config.of_run(trainer)
        return cls(
            config, evaluate=evaluate, name="EvalHook" if own else f"EvalHook[every={config.every}]"
        )

    def on_train_begin(self, info: StepInfo) -> None:
        if self.config.at_start and self.last_step != info.step:  # a resumed run already has it
            info.control.eval()

    def on_step(self, info: StepInfo) -> None:
        if info.step % self.config.every == 0 or info.step in self.steps:
            info.control.eval()

    def on_train_end(self, info: StepInfo) -> None:
        if self.config.at_end and self.last_step != info.step:
            info.control.eval()

    def run_eval(self, info: StepInfo) -> dict[str, float] | None:
        if self.last_step == info.step:
            return None
        results = self.evaluate(info.eval_model)
        self.history.append((info.step, results))
        self.last_step = info.step
        logger.info("eval at step %d: loss %.4f", info.step, results["eval/loss"])
        return results

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "history": [[s, r] for s, r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = state["last_step"]
        self.history = [(s, r) for s, r in state["history"]]


def _own_evaluator(sets: dict[str, list[Any]], context: HookContext) -> Evaluator:
    """An evaluator of ``sets`` (a subset of the run's validation batches)."""
    count = None
    if context.tokenizer is not None and context.vocab_size:
        count = next_token_bytes(token_byte_lengths(context.tokenizer, context.vocab_size))
    return make_loss_evaluator(
        context.loss_fn,
        sets,
        context.trainer_config.policy,
        jit=context.runtime.jit,
        prepare=context.runtime.shard_batch,
        count_bytes=count,
        microbatch_rows=context.trainer_config.eval_microbatch_rows(
            context.runtime.data_parallel_size
        ),
    )
