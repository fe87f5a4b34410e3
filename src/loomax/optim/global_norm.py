"""The global L2 norm of an array tree, computed once per traced step and shared.

A train step takes the norm of the same gradients up to three times: gradient clipping
scales by it, skip-bad-steps checks it, the step reports it (``optim/grad_norm``), and the
norms hook logs it again. XLA merges the copies when it compiles, but each is traced and
lowered first (a tiny GPT-2's norm is ~100 of the step's ~1,300 equations, clipping ~150).
Inside ``norms_shared()`` (the train step's trace) ``global_norm`` of the very same arrays
(the same tracer objects, in the same trace) is traced once. Its value has the same bits at
any sharding (``_norm``), so a run resumed on another layout (another stage count) clips
alike; it equals ``optax.tree.norm``'s to float32 rounding.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import get_opaque_trace_state
from jax.sharding import NamedSharding, PartitionSpec

from loomax.mesh import current_mesh

_local = threading.local()


@contextlib.contextmanager
def norms_shared() -> Iterator[None]:
    """Within: ``global_norm`` of arrays it has seen in the current trace returns the norm it
    traced then (the memo lasts for the block, in this thread)."""
    previous = getattr(_local, "memo", None)
    _local.memo = {}
    try:
        yield
    finally:
        _local.memo = previous


def global_norm(tree: Any) -> jax.Array:
    """``sqrt(sum of squares)`` of every array in ``tree`` (``_norm``: the same bits at any
    sharding); traced once per set of arrays inside ``norms_shared()``."""
    leaves = jax.tree.leaves(tree)
    memo = getattr(_local, "memo", None)
    if memo is None:
        return _norm(leaves)
    key = tuple(map(id, leaves))
    trace = get_opaque_trace_state()
    hit = memo.get(key)
    if hit is not None and hit[1] == trace:  # the same objects, alive since (``hit[0]``)
        return hit[2]
    norm = _norm(leaves)
    memo[key] = (leaves, trace, norm)
    return norm


def _norm(leaves: list) -> jax.Array:
    """The L2 norm (float32) with the same bits however the arrays are sharded: each array's
    squares summed over all but its first axis (per layer of a stacked array, whatever the
    ``stage`` split of the layers), those sums gathered whole and added in order, then the
    arrays' totals in tree order. (A sum over a sharded array adds each device's share, then
    the devices': its bits would follow the layout.)"""
    mesh = current_mesh()
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        sq = jnp.square(jnp.abs(x).astype(jnp.float32))
        rows = jnp.sum(sq, axis=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq
        if mesh is not None and mesh.size > 1 and rows.ndim:
            rows = jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, PartitionSpec()))
        total = total + jnp.sum(rows)
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the updates by ``max_norm / norm`` where their global norm exceeds ``max_norm``
    (the values of ``optax.clip_by_global_norm``), the norm from ``global_norm``."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        within = norm < max_norm
        scale = lambda u: jax.lax.select(within, u, u / norm.astype(u.dtype) * max_norm)  # noqa: E731
        return jax.tree.map(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
