"""The loss's tail handed to a staged stack: inside the loop, or after it by stages.

1F1B, interleaved 1F1B and zero-bubble start a microbatch's backward as soon as its forward
has left the last stage, so the last stage must compute that microbatch's loss inside the
pipeline loop. The objective (``models/loss.py``) describes what follows the layer stack
with a ``StageTail`` (the model's final layer, the LM head and the cross-entropy of one
microbatch's rows, with their targets and weights) and enters ``tail_context`` around the
model's forward pass; the staged stack (``models/blocks/pipeline.py``) then runs the whole
loss and its gradient per slot (``pipeline_explicit.py``) and leaves the loss in
``StageTail.loss``. Under GPipe and interleaved the stack runs the tail after its forward
loop (``after_loop``: whole microbatches per stage, gradients in one pairwise tree, so
the bits do not depend on the stage count). Without a tail in context (evaluation's
logits, generation) the stack runs its forward loop as usual."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.models.axes import Embed, Position, Vocab
from loomax.stages import LOSS_IN_LOOP_SCHEDULES, STAGE_AXIS, current_pipeline


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


def in_loop() -> bool:
    """Whether the schedule in context runs the tail inside its loop (else after it)."""
    return current_pipeline().schedule in LOSS_IN_LOOP_SCHEDULES


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
    if stages == 1:
        return None
    if not hasattr(model, "final_hidden") or not hasattr(model, "blocks"):
        if not wanted(stages):  # gpipe, interleaved: the loss after the loop, in the global view
            return None
        raise ConfigError(
            f"trainer.pipeline.schedule {current_pipeline().schedule!r}: "
            f"{type(model).__name__} has no final_hidden (the loss inside the loop needs "
            "the model's last layer apart); use gpipe or interleaved"
        )
    schedule = current_pipeline().schedule
    two_stacks = getattr(model, "dense_blocks", None) is not None
    if (two_stacks or getattr(model, "mtp", None) is not None) and not wanted(stages):
        return None  # gpipe, interleaved: the loss after the loop, in the global view
    if two_stacks:
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


def loss_of(tail: StageTail) -> jax.Array | None:
    """The loss the staged stack left in ``tail``; a ``ConfigError`` when no stack ran it
    under a schedule that needs one (None under the others: a mixture of experts' stack
    leaves the loss to the objective)."""
    if tail.loss is None and in_loop():
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


def after_loop(
    tail: StageTail,
    mesh: jax.sharding.Mesh,
    stages: int,
    out: jax.Array,
    rows: list[jax.Array],
    inner: dict,
    named: Callable[[jax.Array], NamedArray],
) -> tuple[jax.Array, Any, jax.Array]:
    """``(loss, tail gradients, gradient of out)`` of the tail on the forward loop's outputs
    ``out`` ``(m, rows / m, ...)`` (``rows``: targets and weights laid out alike), for the
    schedules whose loss follows the loop (``gpipe``, ``interleaved``). Stage ``s`` takes
    microbatches ``[s k, (s + 1) k)``, ``k = m / stages``, each on the data shard's rows of
    it (so its head's work is ``1 / stages`` of the shard's); the tail's gradients are summed
    over a stage's microbatches pairwise, then over the stages pairwise (``ppermute``: stage
    ``s`` adds stage ``s ^ 2**l``'s), so with ``k`` and ``stages`` powers of two they are one
    pairwise tree over the ``m`` microbatches at any stage count: the same bits. Losses and
    input gradients are each one stage's (zeros elsewhere): summed exactly."""
    m = out.shape[0]
    k, ragged = -(-m // stages), m % stages != 0

    def body(params, out, t, w):
        s = jax.lax.axis_index(STAGE_AXIS)
        losses, g_out, partials = jnp.zeros((m,), jnp.float32), jnp.zeros_like(out), []
        for j in range(k):
            i = s * k + j
            valid = i < m
            i = jnp.minimum(i, m - 1) if ragged else i

            def f(tp, h, i=i):
                with hax.axis_mapping(inner):  # stage is manual in here
                    return tail.fn(tp, named(h), t[i], w[i]).astype(jnp.float32)

            loss_i, vjp = jax.vjp(f, params, out[i])
            g_p, g_h = vjp(jnp.ones_like(loss_i))
            if ragged:  # the last stage's surplus slots: recomputed, then zeroed
                g_p = jax.tree.map(lambda g, v=valid: jnp.where(v, g, 0), g_p)
                loss_i, g_h = jnp.where(valid, loss_i, 0), jnp.where(valid, g_h, 0)
            losses, g_out = losses.at[i].add(loss_i), g_out.at[i].add(g_h)
            partials = _pairwise_push(partials, g_p)
        total = jnp.sum(jax.lax.psum(losses, STAGE_AXIS))
        g_out = jax.lax.psum(g_out, STAGE_AXIS)
        return total, _over_stages(_pairwise_end(partials), stages), g_out

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P(), P()),
        out_specs=(P(), P(), P()),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    return run(*jax.lax.stop_gradient((tail.params, out, *rows)))


def _pairwise_push(partials: list[tuple[int, Any]], tree: Any) -> list[tuple[int, Any]]:
    """``partials`` (``(count, sum)`` of consecutive trees, counts falling) with ``tree`` added:
    equal counts merge, earlier + later, so the trees are summed as one pairwise tree in
    their order while at most ``log2`` of their number wait (a binary counter)."""
    partials = [*partials, (1, tree)]
    while len(partials) > 1 and partials[-1][0] == partials[-2][0]:
        (n, a), (_, b) = partials[-2], partials[-1]
        partials = [*partials[:-2], (2 * n, jax.tree.map(jnp.add, a, b))]
    return partials


def _pairwise_end(partials: list[tuple[int, Any]]) -> Any:
    """The sum of what ``_pairwise_push`` holds (one partial for a power of two)."""
    total = partials[-1][1]
    for _, tree in reversed(partials[:-1]):
        total = jax.tree.map(jnp.add, tree, total)
    return total


def _over_stages(tree: Any, stages: int) -> Any:
    """``tree`` summed over ``stage``: for a power of two, a pairwise tree over the stages in
    order (every stage ends with the same bits; ``a + b`` is ``b + a``), else ``psum``."""
    if stages & (stages - 1):
        return jax.lax.psum(tree, STAGE_AXIS)
    level = 1
    while level < stages:
        pairs = [(i, i ^ level) for i in range(stages)]
        tree = jax.tree.map(jnp.add, tree, jax.lax.ppermute(tree, STAGE_AXIS, pairs))
        level *= 2
    return tree
