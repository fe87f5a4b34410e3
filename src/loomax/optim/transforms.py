"""Small optax transforms the optimizers are chained from (gradient and update clipping,
raw-array adapters), and the gradients' global norm."""

from __future__ import annotations

from typing import NamedTuple

import haliax as hax
import jax
import jax.numpy as jnp
import optax

from loomax.optim.global_norm import global_norm
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
        norm = global_norm(updates).astype(jnp.float32)
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
