"""The pure train step: ``(state, batch) -> (state, metrics)``, with microbatch accumulation."""

from __future__ import annotations

import contextlib
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

from loomax.models.attention import max_logits
from loomax.models.blocks import offload, taps
from loomax.models.blocks.buffers import (
    buffer_mask,
    has_buffers,
    split_state,
    update_state,
    without_buffers,
)
from loomax.optim.qk_clip import clip_model
from loomax.optim.transforms import global_norm
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

    The arrays inside a ``Buffer`` (``loomax.models.blocks.buffers``) are never trained. Returns an
    ``eqx.partition`` filter: ``eqx.is_inexact_array`` when nothing is frozen and the model
    has no buffers, else a pytree of bools like ``model``.
    """
    buffers = has_buffers(model)
    if not freeze and not buffers:
        return eqx.is_inexact_array
    from loomax.optim.mask import regex_mask

    frozen = regex_mask(model, list(freeze)) if freeze else jax.tree.map(lambda _: False, model)
    inside = buffer_mask(model) if buffers else jax.tree.map(lambda _: False, model)
    trained = lambda x, f, b: eqx.is_inexact_array(x) and not f and not b  # noqa: E731
    return jax.tree.map(trained, model, frozen, inside)


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
    """``model``'s trained parameters (``trainable_mask``), None elsewhere (a whole ``Buffer``
    too): what the optimizer sees."""
    return without_buffers(eqx.filter(model, trainable_mask(model, freeze)))


KEEP_NAMES = ("activations/", "moe/", "dpo/", "rl/", "sft/", "mtp/")
"""Prefixes of loss metrics the step reports under their own name (not ``train/<name>``)."""


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
    offload_params: bool = False,
    activation_stats: bool = False,
    qk_clip_tau: float | None = None,
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
    ``offload_params`` the model's stacked layers come in from host memory: the forward and
    backward passes fetch them one layer at a time (``loomax.models.blocks.offload.scan``, which
    also casts them for compute), their gradients go back to host memory, and the update
    runs on the host (``update_on_host``: there the parameters are updated where they rest)
    or, streamed, on the devices (the jit's output shardings put them back); microbatches'
    gradients are accumulated on the devices. With
    ``activation_stats`` the forward pass's activation statistics (``loomax.models.blocks.taps``)
    join the metrics as ``activations/<where>/<stat>`` (averaged over microbatches). With
    ``qk_clip_tau`` (QK-clip, ``loomax.optim.qk_clip``) the attention's per-head maximum logits
    of the batch (the largest over microbatches) rescale the query and key projections after
    the update (``clip_model``), logged as ``optim/max_logit`` and ``optim/qk_clipped_heads``.
    """
    if qk_clip_tau is not None and offload_params:
        raise ValueError("optimizer.qk_clip_tau is not supported with trainer.offload_params")

    def cast_for_compute(model):
        if not offload_params:
            return mp.cast_to_compute(model), contextlib.nullcontext()
        # host-resident arrays are cast one layer at a time, once fetched
        on_device = mp.cast_to_compute(eqx.filter(model, offload.on_host, inverse=True))
        model = eqx.combine(on_device, eqx.filter(model, offload.on_host))
        return model, offload.casting(mp.cast_to_compute)

    def loss_sum(trained, frozen, batch, key):
        model, fetching = cast_for_compute(eqx.combine(trained, frozen))
        tapping = taps.collect() if activation_stats else contextlib.nullcontext({})
        peaks = max_logits.collecting() if qk_clip_tau else contextlib.nullcontext({})
        with fetching, tapping as recorded, peaks as seen:
            total, weight, sums = split_loss(loss_fn(model, batch, key=key))
        stats = {k: (v * weight, weight) for k, v in taps.flatten(recorded).items()}
        return total, (weight, {**sums, **stats}, dict(seen))

    value_and_grad = eqx.filter_value_and_grad(loss_sum, has_aux=True)  # w.r.t. ``trained``

    def grad_fn(*args):
        out, grads = value_and_grad(*args)
        return out, grads if grad_mapping is None else hax.shard(grads, grad_mapping)

    optimizer = optax.with_extra_args_support(optimizer)  # the loss goes in as ``value``

    def sum_and_grads(model, batch, key):
        trained, frozen = eqx.partition(model, trainable_mask(model, freeze))
        trained = without_buffers(trained)
        if num_microbatches == 1:
            (total, (weight, sums, peaks)), grads = grad_fn(trained, frozen, batch, key)
            return total, weight, sums, grads, peaks

        # microbatch i = rows i, i + n, i + 2n, ...: every device's contiguous rows hold an
        # equal share of each microbatch, so splitting moves no data between devices
        micro = jax.tree.map(
            lambda x: x.reshape(-1, num_microbatches, *x.shape[1:]).swapaxes(0, 1), batch
        )
        keys = jax.random.split(key, num_microbatches)
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(trained, eqx.is_inexact_array))
        zeros = zeros if grad_mapping is None else hax.shard(zeros, grad_mapping)

        first = jax.tree.map(lambda x: x[0], micro)
        _, (_, sum_shapes, peak_shapes) = eqx.filter_eval_shape(
            loss_sum, trained, frozen, first, keys[0]
        )

        def body(carry, xs):
            total, weight, sums, grads, peaks = carry
            (t, (w, s, p)), g = grad_fn(trained, frozen, *xs)
            g = _on_device(g) if offload_params else g  # accumulated on the devices
            grads, peaks = jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.maximum, peaks, p)
            return (total + t, weight + w, add_sums(sums, s), grads, peaks), None

        f32 = jnp.zeros((), jnp.float32)
        lowest = jax.tree.map(lambda x: jnp.full(x.shape, -jnp.inf, x.dtype), peak_shapes)
        init = (f32, f32, zero_sums(sum_shapes), zeros, lowest)
        (total, weight, sums, grads, peaks), _ = jax.lax.scan(body, init, (micro, keys))
        return total, weight, sums, grads, peaks

    def train_step(state: TrainerState, batch) -> tuple[TrainerState, Metrics]:
        key, step_key = jax.random.split(state.key)
        total, weight, sums, grads, peaks = sum_and_grads(state.model, batch, step_key)
        loss = total / weight
        before, opt_state = state.model, state.opt_state
        if offload_params and update_on_host:  # parameters updated where they rest
            params = trainable_params(before, freeze)
            out = _update_params_on_host(optimizer, grads, weight, opt_state, params, loss)
            grad_norm, grads, updates, new_params, opt_state = out
            rest = eqx.filter(before, trainable_mask(before, freeze), inverse=True)
            model = _placed_like(eqx.combine(new_params, rest), before)
            grad_norm, grads, updates, before = _on_device((grad_norm, grads, updates, before))
        else:
            if offload_params:  # streamed: the model and its gradients on the devices to update
                grads, before = _on_device((grads, before))
            grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)
            params = trainable_params(before, freeze)
            if update_on_host:
                updates, opt_state = _update_on_host(optimizer, grads, opt_state, params, loss)
            else:
                if offload_optimizer_state:
                    opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
                updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
            model = eqx.apply_updates(before, updates)
            grad_norm = global_norm(grads)
        values, state_stats = split_state(metric_values(sums))
        model = update_state(model, state_stats)  # buffers: outside the optimizer
        metrics: Metrics = {"train/loss": loss, "optim/grad_norm": grad_norm}
        if qk_clip_tau:  # MuonClip's QK-clip: after the update, from this batch's logits
            model, clipped = clip_model(model, peaks, qk_clip_tau)
            metrics.update(clipped)
        for name, value in values.items():  # activations/..., moe/... keep their name
            metrics[name if name.startswith(KEEP_NAMES) else f"train/{name}"] = value
        reported = optimizer_state_metrics(opt_state)
        metrics.update(
            jax.device_put(reported, jax.memory.Space.Device) if update_on_host else reported
        )
        if lr_schedule is not None:
            metrics["optim/learning_rate"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        after = _on_device(model) if offload_params else model  # hooks see device arrays
        context = StepContext(state.step, before, grads, updates, loss, after)
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


def _update_params_on_host(
    optimizer: optax.GradientTransformationExtraArgs,
    grads: Any,
    weight: jax.Array,
    host_state: Any,
    params: Any,
    loss: jax.Array,
) -> tuple[jax.Array, Any, Any, Any, Any]:
    """``trainer.offload_params`` with the update on the host: the gradient sums (the
    stacked layers' already in host memory) are divided by the batch weight, their norm
    taken, the optimizer's update computed and applied, all by the host. Returns the norm,
    the gradients, the updates, the new parameters (all in host memory) and the state."""

    def update(grads, weight, state, params, loss):
        grads, weight, state, params, loss = jax.device_put(
            (grads, weight, state, params, loss), jax.memory.Space.Device
        )  # on the host, its own memory is the default space
        grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)
        updates, state = optimizer.update(grads, state, params, value=loss)
        return optax.tree.norm(grads), grads, updates, eqx.apply_updates(params, updates), state

    to_host = lambda tree: jax.device_put(tree, jax.memory.Space.Host)  # noqa: E731
    with compute_on("device_host"):
        return jax.jit(update)(
            to_host(grads), to_host(weight), host_state, to_host(params), to_host(loss)
        )


def _on_device(tree: Any) -> Any:
    """``tree`` with its host-resident arrays moved to device memory."""
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device) if offload.on_host(x) else x, tree
    )


def _placed_like(tree: Any, like: Any) -> Any:
    """``tree`` (host-resident) with the arrays that rest on the devices in ``like`` moved there."""
    return jax.tree.map(
        lambda x, ref: x if offload.on_host(ref) else jax.device_put(x, jax.memory.Space.Device),
        tree,
        like,
    )


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
