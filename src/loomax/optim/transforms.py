"""Small optax transforms the optimizers are chained from (gradient and update clipping,
raw-array adapters), and the gradients' global norm."""

from __future__ import annotations

from typing import NamedTuple

import haliax as hax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from loomax.mesh import current_mesh
from loomax.tree_paths import is_named_array


def global_norm(tree) -> jax.Array:
    """The L2 norm of ``tree``'s arrays (float32), with the same bits however they are
    sharded: each array's squares are summed over all but its first axis (per layer of a
    stacked array, whatever the ``stage`` split of the layers), those sums gathered whole and
    added in order, then the arrays' totals in tree order. (A sum over a sharded array adds
    each device's share, then the devices': its bits followed the layout.)"""
    mesh = current_mesh()
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        sq = jnp.square(jnp.abs(x).astype(jnp.float32))
        rows = jnp.sum(sq, axis=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq
        if mesh is not None and mesh.size > 1 and rows.ndim:
            rows = jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, PartitionSpec()))
        total = total + jnp.sum(rows)
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the gradients down to global norm ``max_norm`` when it is above (``global_norm``:
    the same bits at any sharding, so a run resumed on another layout clips alike)."""

    def update(updates, state, params=None):
        norm = global_norm(updates)
        keep = norm < max_norm
        scaled = lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(scaled, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


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
