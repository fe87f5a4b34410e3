"""Skip bad steps: drop the update of a step whose loss or gradient norm spikes.

``skip_bad_steps(inner, window, k)`` wraps any optax transformation. It keeps the last
``window`` losses and gradient norms of accepted steps; when a step's loss or gradient
norm exceeds ``mean + k * std`` of that history (or is NaN/Inf), the update is zero and
the inner optimizer state is kept as it was, so the step leaves no trace but its count.

The loss reaches the transform through optax's extra arguments:
``opt.update(grads, state, params, value=loss)`` (the train step passes it). Without a
``value`` only the gradient norm is checked.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from loomax.optim.global_norm import global_norm


class SkipBadStepsState(NamedTuple):
    """The inner state plus the rolling history of accepted steps."""

    inner: optax.OptState
    losses: jax.Array
    """Ring buffer of the last ``window`` accepted losses."""
    grad_norms: jax.Array
    """Ring buffer of the last ``window`` accepted gradient norms."""
    count: jax.Array
    """Accepted steps recorded so far (the buffers hold ``min(count, window)``)."""
    skipped: jax.Array
    """1 if the last step was skipped, else 0."""
    total_skipped: jax.Array
    """Steps skipped since the start of training."""

    def step_metrics(self) -> dict[str, jax.Array]:
        """``optim/skipped_step`` (1 if this step was skipped) and the running total."""
        return {
            "optim/skipped_step": self.skipped.astype(jnp.float32),
            "optim/skipped_steps_total": self.total_skipped.astype(jnp.float32),
        }


def skip_bad_steps(
    inner: optax.GradientTransformation,
    *,
    window: int = 100,
    k: float = 6.0,
    min_history: int = 10,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that steps with a loss or grad norm above ``mean + k * std`` are skipped.

    Nothing is skipped until ``min_history`` accepted steps are recorded, except steps
    whose loss or gradient norm is not finite, which are always skipped.
    """
    if window < 2:
        raise ValueError(f"skip_bad_steps window must be >= 2, got {window}")
    if k <= 0:
        raise ValueError(f"skip_bad_steps k must be > 0, got {k}")
    if not 1 <= min_history <= window:
        raise ValueError(f"skip_bad_steps min_history must be in [1, window], got {min_history}")
    inner = optax.with_extra_args_support(inner)

    def init(params) -> SkipBadStepsState:
        zeros = jnp.zeros((window,), jnp.float32)
        zero = jnp.zeros((), jnp.int32)
        return SkipBadStepsState(inner.init(params), zeros, zeros, zero, zero, zero)

    def update(updates, state: SkipBadStepsState, params=None, *, value=None, **extra):
        grad_norm = global_norm(updates).astype(jnp.float32)
        loss = jnp.asarray(0.0 if value is None else value, jnp.float32)
        filled = jnp.minimum(state.count, window)
        enough = state.count >= min_history
        bad = ~jnp.isfinite(loss) | ~jnp.isfinite(grad_norm)
        bad |= enough & _above(grad_norm, state.grad_norms, filled, k)
        if value is not None:
            bad |= enough & _above(loss, state.losses, filled, k)

        new_updates, new_inner = inner.update(updates, state.inner, params, value=value, **extra)
        out_updates = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), new_updates)
        kept_inner = jax.tree.map(lambda old, new: jnp.where(bad, old, new), state.inner, new_inner)

        slot = state.count % window
        losses = jnp.where(bad, state.losses, state.losses.at[slot].set(loss))
        grad_norms = jnp.where(bad, state.grad_norms, state.grad_norms.at[slot].set(grad_norm))
        skipped = bad.astype(jnp.int32)
        return out_updates, SkipBadStepsState(
            kept_inner,
            losses,
            grad_norms,
            state.count + 1 - skipped,
            skipped,
            state.total_skipped + skipped,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _above(x: jax.Array, history: jax.Array, filled: jax.Array, k: float) -> jax.Array:
    """Whether ``x > mean + k * std`` of the first ``filled`` entries of ``history``."""
    mask = jnp.arange(history.shape[0]) < filled
    n = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, history, 0.0)) / n
    var = jnp.sum(jnp.where(mask, (history - mean) ** 2, 0.0)) / n
    return x > mean + k * jnp.sqrt(var)
