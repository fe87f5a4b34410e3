"""The loss's tail handed to a staged stack, for the schedules that run the loss inside the loop.

1F1B, interleaved 1F1B and zero-bubble start a microbatch's backward as soon as its forward
has left the last stage, so the last stage must compute that microbatch's loss inside the
pipeline loop. The objective (``models/loss.py``) describes what follows the layer stack
with a ``StageTail`` (the model's final layer, the LM head and the cross-entropy of one
microbatch's rows, with their targets and weights) and enters ``tail_context`` around the
model's forward pass; the staged stack (``models/blocks/pipeline.py``) then runs the whole
loss and its gradient per slot (``pipeline_explicit.py``) and leaves the loss in
``StageTail.loss``. Without a tail in context (evaluation's logits, generation, GPipe) the
stack runs its forward loop as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.config import ConfigError
from loomax.models.axes import Embed, Position, Vocab
from loomax.stages import LOSS_IN_LOOP_SCHEDULES, current_pipeline


@dataclass
class StageTail:
    """What follows the layer stack, per microbatch: ``loss(params, h, targets, weights)``,
    the sum of the token losses of stack outputs ``h`` (a ``NamedArray``), differentiable in
    ``params`` (an array pytree: the model without its blocks); ``loss`` is set by the stack.
    ``aux_loss(stats)``: the per-token loss terms the model adds for its stack's statistics
    (a mixture of experts' ``RouterAux``), linear in them; None: no such terms."""

    params: Any
    fn: Callable[[Any, NamedArray, jax.Array, jax.Array], jax.Array]
    targets: jax.Array
    weights: jax.Array
    loss: jax.Array | None = None
    aux_loss: Callable[[Any], jax.Array] | None = None


_TAIL = contextvars.ContextVar[StageTail | None]("loomax_stage_tail", default=None)


def wanted(stages: int) -> bool:
    """Whether the pipeline in context runs the loss inside its loop (``stages`` > 1)."""
    return stages > 1 and current_pipeline().schedule in LOSS_IN_LOOP_SCHEDULES


def loss_tail(
    model,
    ce: Callable,
    targets: NamedArray,
    weights: NamedArray,
    stages: int,
    aux_losses: bool = True,
) -> StageTail | None:
    """``model``'s tail for the schedule in context, or None when it does not need one.
    ``ce(h, w, t, m)`` is the cross-entropy sum of rows ``h [tokens, embed]`` against head
    ``w [vocab, embed]``; ``targets`` and ``weights`` are ``(batch, position)``. With
    ``aux_losses`` the model's ``router_losses(stats)`` (a mixture of experts') become the
    tail's ``aux_loss``, their sum."""
    if not wanted(stages):
        return None
    if not hasattr(model, "final_hidden") or not hasattr(model, "blocks"):
        raise ConfigError(
            f"trainer.pipeline.schedule {current_pipeline().schedule!r}: "
            f"{type(model).__name__} has no final_hidden (the loss inside the loop needs "
            "the model's last layer apart); use gpipe or interleaved"
        )
    schedule = current_pipeline().schedule
    if getattr(model, "dense_blocks", None) is not None:
        raise ConfigError(
            f"trainer.pipeline.schedule {schedule!r}: {type(model).__name__} has dense first "
            "layers (model.moe.first_dense_layers), a second layer stack (the loss inside "
            "the loop runs one); use gpipe or interleaved, or first_dense_layers: 0"
        )
    if getattr(model, "mtp", None) is not None:
        raise ConfigError(
            f"trainer.pipeline.schedule {schedule!r}: multi-token prediction "
            "(model.mtp_depth) reads the stack's output, which stays inside the loop; use "
            "gpipe or interleaved, or mtp_depth: 0"
        )
    rest = eqx.tree_at(lambda m: m.blocks, model, None)
    params, static = eqx.partition(rest, eqx.is_array)

    def fn(params, h: NamedArray, t: jax.Array, m: jax.Array) -> jax.Array:
        tail = eqx.combine(params, static)
        hidden = tail.final_hidden(h).rearrange((..., Position, Embed)).array
        w = tail.lm_head_weight().rearrange((Vocab, Embed)).array
        return ce(
            hidden.reshape(-1, w.shape[1]), w.astype(hidden.dtype), t.reshape(-1), m.reshape(-1)
        )

    terms = getattr(model, "router_losses", None) if aux_losses else None

    def aux_loss(stats) -> jax.Array:
        return sum(terms(stats).values(), jnp.zeros((), jnp.float32))

    order = targets.axes
    tail = StageTail(params, fn, targets.array, weights.rearrange(order).array)
    return tail if terms is None else dataclasses.replace(tail, aux_loss=aux_loss)


@contextlib.contextmanager
def tail_context(tail: StageTail | None) -> Iterator[None]:
    """Within it, ``current_tail()`` is ``tail``."""
    token = _TAIL.set(tail)
    try:
        yield
    finally:
        _TAIL.reset(token)


def current_tail() -> StageTail | None:
    """The tail in context (None: the stack's forward loop alone)."""
    return _TAIL.get()


def loss_of(tail: StageTail) -> jax.Array:
    """The loss the staged stack left in ``tail``; a ``ConfigError`` when no stack ran it."""
    if tail.loss is None:
        raise ConfigError(
            f"trainer.pipeline.schedule {current_pipeline().schedule!r}: this model's layers "
            "did not run as one staged stack (the loss inside the loop needs one); use gpipe"
        )
    return tail.loss


def surrogate(loss: jax.Array, pairs: list[tuple[Any, Any]]) -> jax.Array:
    """``loss`` whose gradient in each ``(primal, gradient)`` pair's primal is its gradient:
    ``loss + sum <p - stop_gradient(p), g>`` (the added terms are exactly 0), so the step's
    autodiff takes the gradients the loop computed without differentiating the loop."""
    total = loss
    for primal, grad in pairs:
        for p, g in zip(jax.tree.leaves(primal), jax.tree.leaves(grad), strict=True):
            p = p.array if isinstance(p, NamedArray) else p
            delta = (p - jax.lax.stop_gradient(p)).astype(loss.dtype)
            total = total + jnp.vdot(delta, g.astype(loss.dtype))
    return total
