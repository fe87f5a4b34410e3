"""Small optax transforms the optimizers are chained from (update clipping, Muon's orthogonalisation)."""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import optax

from loomax.tree_paths import is_named_array


def clip_update_rms(threshold: float) -> optax.GradientTransformation:
    """Scale each parameter's update down so that its root-mean-square is at most ``threshold``."""

    def update(updates, state, params=None):
        def clip(u):
            rms = jnp.sqrt(jnp.mean(jnp.square(u.astype(jnp.float32))))
            return (u * jnp.minimum(1.0, threshold / jnp.maximum(rms, 1e-12))).astype(u.dtype)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class UpdateNormHistory(NamedTuple):
    """Ring buffer of the last update norms and how many were recorded."""

    norms: jax.Array
    count: jax.Array


def clip_update_norm(window: int, sigma_factor: float) -> optax.GradientTransformation:
    """Clip the global update norm to ``mean + sigma_factor * std`` of the last ``window`` norms.

    Nothing is clipped until the window is full; the recorded norm is the clipped one, so
    one spike does not raise the threshold for the steps after it.
    """
    if window < 2:
        raise ValueError(
            f"optimizer.clip_update_norm.rolling_interval_length must be >= 2, got {window}"
        )

    def init(params):
        return UpdateNormHistory(jnp.zeros((window,), jnp.float32), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        norm = optax.tree.norm(updates).astype(jnp.float32)
        mean = jnp.mean(state.norms)
        limit = mean + sigma_factor * jnp.std(state.norms)
        full = state.count >= window
        scale = jnp.where(full & (norm > limit), limit / jnp.maximum(norm, 1e-12), 1.0)
        updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
        norms = state.norms.at[state.count % window].set(norm * scale)
        return updates, UpdateNormHistory(norms, state.count + 1)

    return optax.GradientTransformation(init, update)


_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: jax.Array, steps: int) -> jax.Array:
    """Approximately orthogonalise the last two dims of ``g`` (quintic Newton-Schulz iteration)."""
    a, b, c = _NS_COEFFS
    wide = g.shape[-2] <= g.shape[-1]
    x = g.astype(jnp.float32)
    x = x if wide else jnp.swapaxes(x, -1, -2)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x if wide else jnp.swapaxes(x, -1, -2)
    return x.astype(g.dtype)


def _names(axes) -> tuple[str, ...]:
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(a.name if isinstance(a, hax.Axis) else a for a in axes)


def orthogonalize_linear(steps: int = 5) -> optax.GradientTransformation:
    """Replace each ``Linear`` weight update by its orthogonalisation (Out x In matrix).

    Axes that are neither In nor Out (e.g. ``layers`` of stacked blocks) are batch dims.
    The result is scaled by ``0.2 * sqrt(max(out, in))`` so its RMS matches AdamW's.
    Other leaves pass through unchanged.
    """

    def orthogonalize(node):
        if not isinstance(node, hnn.Linear) or not isinstance(node.weight, hax.NamedArray):
            return node
        w = node.weight
        ins, outs = _names(node.In), _names(node.Out)
        batch = tuple(n for n in (a.name for a in w.axes) if n not in ins and n not in outs)
        w = w.rearrange((*batch, *outs, *ins))
        nb = len(batch)
        fan_out = math.prod(w.array.shape[nb : nb + len(outs)])
        fan_in = math.prod(w.array.shape[nb + len(outs) :])
        flat = w.array.reshape(*w.array.shape[:nb], fan_out, fan_in)
        ortho = newton_schulz(flat, steps) * (0.2 * max(fan_out, fan_in) ** 0.5)
        named = hax.NamedArray(ortho.reshape(w.array.shape), w.axes)
        return eqx.tree_at(lambda m: m.weight, node, named.rearrange(node.weight.axes))

    def update(updates, state, params=None):
        return jax.tree.map(
            orthogonalize, updates, is_leaf=lambda x: isinstance(x, hnn.Linear)
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def on_raw_arrays(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run ``inner`` on the plain arrays inside NamedArrays (for transforms whose state
    changes a leaf's shape, e.g. factored statistics, which cannot keep axis names)."""

    def strip(tree):
        return jax.tree.map(
            lambda x: x.array if is_named_array(x) else x, tree, is_leaf=is_named_array
        )

    def init(params):
        return inner.init(strip(params))

    def update(updates, state, params=None):
        raw, state = inner.update(strip(updates), state, None if params is None else strip(params))
        named = jax.tree.map(
            lambda orig, new: hax.NamedArray(new, orig.axes) if is_named_array(orig) else new,
            updates,
            raw,
            is_leaf=is_named_array,
        )
        return named, state

    return optax.GradientTransformation(init, update)
