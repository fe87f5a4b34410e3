"""The pure train step: ``(state, batch) -> (state, metrics)``, with microbatch accumulation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import optax
from jax.experimental.compute_on import compute_on

from loomax.models import taps
from loomax.train.loss_metrics import add_sums, metric_values, split_loss, zero_sums
from loomax.train.state import TrainerState

Metrics = dict[str, jax.Array]
TRACED = "traced"
"""Key of the step's metrics under which the ``JitHook`` outputs travel (a tuple, in hook
order); the trainer takes them out and hands each to its hook, never to the tracker."""


class LossFn(Protocol):
    """``loss_fn(model, batch, *, key) -> (sum of losses, weight)``; the mean is sum / weight.

    It may also return ``((sum, weight), metrics)``: scalars the step reports as
    ``train/<name>`` and the evaluator as ``eval/<name>`` (``loomax.train.loss_metrics``).
    """

    def __call__(self, model: Any, batch: Any, *, key: jax.Array) -> Any: ...


class StepContext(eqx.Module):
    """What a ``JitHook`` sees inside the step: the model before the update and its gradients.

    ``step`` is the number of steps done before this one; ``new_model`` is the model after
    the update.
    """

    step: jax.Array
    model: Any
    grads: Any
    updates: Any
    loss: jax.Array
    new_model: Any = None


@dataclass(frozen=True)
class JitHook:
    """Metrics computed inside the jitted step from a ``StepContext``.

    ``fn`` returns a small dict of scalars (or small arrays). They are private to the hook
    that added the ``JitHook``: it reads them with ``info.traced(jit_hook)``. With
    ``every > 1`` they are computed only on steps whose number (counted from 1, as
    ``StepInfo.step``) is divisible by ``every``, the steps a host hook with the same
    ``every`` sees (other steps carry placeholders nobody reads).
    """

    fn: Callable[[StepContext], Metrics]
    every: int = 1


@dataclass(frozen=True)
class StateExtra:
    """An array pytree a hook keeps in ``TrainerState.extras`` and updates inside the step.

    ``init(params)`` makes it from the initial parameters (the model's inexact arrays);
    ``update(value, context)`` returns its next value after each step. It is sharded like
    the parameters when it mirrors them, and saved in checkpoints with the state.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, StepContext], Any]


def trainable_mask(model: Any, freeze: Sequence[str] = ()) -> Any:
    """Which leaves of ``model`` are trained: its inexact arrays, less those whose dotted
    name (``blocks.stacked.attn.qkv.weight``) matches (``re.search``) one of ``freeze``.

    Returns an ``eqx.partition`` filter: ``eqx.is_inexact_array`` when nothing is frozen,
    else a pytree of bools like ``model``.
    """
    if not freeze:
        return eqx.is_inexact_array
    from loomax.optim.mask import regex_mask

    frozen = regex_mask(model, list(freeze))
    return jax.tree.map(lambda x, f: eqx.is_inexact_array(x) and not f, model, frozen)


def without_frozen(model: Any, freeze: Sequence[str]) -> tuple[Any, list[str]]:
    """``model`` with its frozen arrays (``freeze``) set to None, and their slash-separated names."""
    from loomax.tree_paths import named_leaves

    if not freeze:
        return model, []
    mask = trainable_mask(model, freeze)
    keep = jax.tree.map(lambda x, t: t or not eqx.is_inexact_array(x), model, mask)
    frozen = eqx.filter(model, keep, inverse=True)
    names = [n for n, x in named_leaves(frozen) if getattr(x, "array", x) is not None]
    return eqx.filter(model, keep), names


def trainable_params(model: Any, freeze: Sequence[str] = ()) -> Any:
    """``model``'s trained parameters (``trainable_mask``), None elsewhere: what the optimizer sees."""
    return eqx.filter(model, trainable_mask(model, freeze))


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    mp: jmp.Policy,
    num_microbatches: int = 1,
    lr_schedule: optax.Schedule | None = None,
    jit_hooks: Sequence[JitHook] = (),
    extras: Mapping[str, StateExtra] | None = None,
    freeze: Sequence[str] = (),
    grad_mapping: Mapping[str, Any] | None = None,
    offload_optimizer_state: bool = False,
    update_on_host: bool = False,
    activation_stats: bool = False,
) -> Callable[[TrainerState, Any], tuple[TrainerState, Metrics]]:
    """Build the pure step. Gradients are of the mean loss over the whole batch.

    With ``num_microbatches > 1`` the batch's leading axis is split and gradients are
    accumulated (in the parameter dtype) by a ``scan``, so that memory is that of one
    microbatch while the result equals the full-batch step. Parameters matched by
    ``freeze`` (``trainable_mask``) get no gradient (none is computed) and no update; the
    optimizer state holds the trained parameters only. With ``grad_mapping`` (ZeRO-2: the
    optimizer mapping) gradients, and their accumulator, are laid out by it: reduce-scattered
    to where the optimizer state rests rather than all-reduced to where parameters do. With
    ``offload_optimizer_state`` the state comes in from host memory and is moved to the
    devices for the update (the jit's output shardings put it back); with ``update_on_host``
    too, the update itself runs on the host and only the gradients and updates cross. With
    ``activation_stats`` the forward pass's activation statistics (``loomax.models.taps``)
    join the metrics as ``activations/<where>/<stat>`` (averaged over microbatches).
    """

    def loss_sum(trained, frozen, batch, key):
        model = mp.cast_to_compute(eqx.combine(trained, frozen))
        if not activation_stats:
            total, weight, sums = split_loss(loss_fn(model, batch, key=key))
            return total, (weight, sums)
        with taps.collect() as recorded:
            total, weight, sums = split_loss(loss_fn(model, batch, key=key))
        stats = {k: (v * weight, weight) for k, v in taps.flatten(recorded).items()}
        return total, (weight, {**sums, **stats})

    value_and_grad = eqx.filter_value_and_grad(loss_sum, has_aux=True)  # w.r.t. ``trained``

    def grad_fn(*args):
        out, grads = value_and_grad(*args)
        return out, grads if grad_mapping is None else hax.shard(grads, grad_mapping)

    optimizer = optax.with_extra_args_support(optimizer)  # the loss goes in as ``value``

    def sum_and_grads(model, batch, key):
        trained, frozen = eqx.partition(model, trainable_mask(model, freeze))
        if num_microbatches == 1:
            (total, (weight, sums)), grads = grad_fn(trained, frozen, batch, key)
            return total, weight, sums, grads

        # microbatch i = rows i, i + n, i + 2n, ...: every device's contiguous rows hold an
        # equal share of each microbatch, so splitting moves no data between devices
        micro = jax.tree.map(
            lambda x: x.reshape(-1, num_microbatches, *x.shape[1:]).swapaxes(0, 1), batch
        )
        keys = jax.random.split(key, num_microbatches)
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(trained, eqx.is_inexact_array))
        zeros = zeros if grad_mapping is None else hax.shard(zeros, grad_mapping)

        first = jax.tree.map(lambda x: x[0], micro)
        _, (_, sum_shapes) = eqx.filter_eval_shape(loss_sum, trained, frozen, first, keys[0])

        def body(carry, xs):
            total, weight, sums, grads = carry
            (t, (w, s)), g = grad_fn(trained, frozen, *xs)
            return (total + t, weight + w, add_sums(sums, s), jax.tree.map(jnp.add, grads, g)), None

        f32 = jnp.zeros((), jnp.float32)
        init = (f32, f32, zero_sums(sum_shapes), zeros)
        (total, weight, sums, grads), _ = jax.lax.scan(body, init, (micro, keys))
        return total, weight, sums, grads

    def train_step(state: TrainerState, batch) -> tuple[TrainerState, Metrics]:
        key, step_key = jax.random.split(state.key)
        total, weight, sums, grads = sum_and_grads(state.model, batch, step_key)
        loss = total / weight
        grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)
        params = trainable_params(state.model, freeze)
        opt_state = state.opt_state
        if update_on_host:
            updates, opt_state = _update_on_host(optimizer, grads, opt_state, params, loss)
        else:
            if offload_optimizer_state:
                opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
            updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
        model = eqx.apply_updates(state.model, updates)
        metrics: Metrics = {"train/loss": loss, "optim/grad_norm": optax.tree.norm(grads)}
        for name, value in metric_values(sums).items():  # activations/... keep their name
            metrics[name if name.startswith("activations/") else f"train/{name}"] = value
        reported = optimizer_state_metrics(opt_state)
        metrics.update(
            jax.device_put(reported, jax.memory.Space.Device) if update_on_host else reported
        )
        if lr_schedule is not None:
            metrics["optim/learning_rate"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        context = StepContext(state.step, state.model, grads, updates, loss, model)
        if jit_hooks:
            metrics[TRACED] = tuple(_run_jit_hook(hook, context) for hook in jit_hooks)
        new_extras = dict(state.extras)
        for name, extra in (extras or {}).items():
            new_extras[name] = extra.update(state.extras[name], context)
        return TrainerState(state.step + 1, model, opt_state, key, new_extras), metrics

    return train_step


def _update_on_host(
    optimizer: optax.GradientTransformationExtraArgs,
    grads: Any,
    host_state: Any,
    params: Any,
    loss: jax.Array,
) -> tuple[Any, Any]:
    """The optimizer's update computed by the host, where ``host_state`` rests.

    The gradients, parameters and loss go to host memory, the update runs there (XLA's
    host compute, ``compute_on("device_host")``) and only the updates come back: the
    optimizer state never occupies device memory.
    """

    def update(grads, state, params, loss):
        # on the host, its own memory is the default space: operands and constants agree
        grads, state, params, loss = jax.device_put(
            (grads, state, params, loss), jax.memory.Space.Device
        )
        return optimizer.update(grads, state, params, value=loss)

    to_host = lambda tree: jax.device_put(tree, jax.memory.Space.Host)  # noqa: E731
    with compute_on("device_host"):
        updates, host_state = jax.jit(update)(
            to_host(grads), host_state, to_host(params), to_host(loss)
        )
    return jax.device_put(updates, jax.memory.Space.Device), host_state


def optimizer_state_metrics(opt_state: Any) -> Metrics:
    """Metrics reported by parts of the optimizer state: every node with a ``step_metrics()``
    method (e.g. skip-bad-steps' ``optim/skipped_step``) contributes its dict."""
    reports = lambda x: callable(getattr(x, "step_metrics", None))  # noqa: E731
    out: Metrics = {}
    for node in jax.tree.leaves(opt_state, is_leaf=reports):
        if reports(node):
            out.update(node.step_metrics())
    return out


def _run_jit_hook(hook: JitHook, context: StepContext) -> Metrics:
    if hook.every == 1:
        return hook.fn(context)
    shapes = jax.eval_shape(hook.fn, context)
    zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    return jax.lax.cond((context.step + 1) % hook.every == 0, hook.fn, zeros, context)
