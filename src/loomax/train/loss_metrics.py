"""Metrics a loss function returns beside its loss, reduced exactly over microbatches and batches.

A loss function returns ``(sum, weight)`` or ``((sum, weight), metrics)``. ``metrics`` is a
dict of scalars, each either a mean over the batch (weighted like the loss: by ``weight``)
or an explicit ``(sum, weight)`` pair (its value is the summed sum over the summed weight;
a weight of ``None`` makes it a plain sum). Whoever runs the loss (the train step, the
evaluator) keeps every metric as a ``(sum, weight)`` pair, adds the pairs of microbatches
and batches, and divides once at the end, so a split batch reports what the whole would.
Metrics named ``state/...`` are a model's state statistics (``loomax.models.blocks.buffers``):
arrays of any shape, reduced the same way, never reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from loomax.models.blocks.buffers import STATE_PREFIX

MetricSums = dict[str, tuple[jax.Array, jax.Array | None]]
"""Each metric as ``(sum, weight)``; ``weight`` None = a plain sum."""

RESERVED = frozenset({"loss", "perplexity", "bpb"})
"""Names the step and the evaluator report themselves; a loss metric may not take them."""


def split_loss(out: Any) -> tuple[jax.Array, jax.Array, MetricSums]:
    """A loss function's return value as ``(sum, weight, metric sums)``."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        (total, weight), metrics = out
    else:
        (total, weight), metrics = out, {}
    sums: MetricSums = {}
    for name, value in metrics.items():
        if name in RESERVED:
            raise ValueError(f"the loss function returned a metric named {name!r}: reserved")
        if isinstance(value, tuple):
            s, w = value
        else:  # a mean over the batch, weighted like the loss
            s, w = value * weight, weight
        s = jnp.asarray(s, jnp.float32) if name.startswith(STATE_PREFIX) else _f32(s)
        sums[name] = (s, None if w is None else _f32(w))
    return total, weight, sums


def zero_sums(sums: MetricSums) -> MetricSums:
    """Sums of zero with the structure (and dtypes) of ``sums`` (also of their shapes)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sums)


def add_sums(a: MetricSums, b: MetricSums) -> MetricSums:
    return jax.tree.map(jnp.add, a, b)


def metric_values(sums: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Each metric's value: its sum over its weight (the sum where the weight is None)."""
    return {name: s if w is None else s / w for name, (s, w) in sums.items()}


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32).reshape(())
