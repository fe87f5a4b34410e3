"""The experts' gated MLP over expert parallelism's receive buffer, and its backward pass.

``expert_ffn`` is ``mm(act(mm(x, gate)) * mm(x, up), down)`` over a buffer ``x [R, D]`` whose
first rows hold the routed rows grouped by local expert (``expert_parallel._GroupedExchange``);
``mm`` is the grouped matmul. The buffer is sized for the dropless worst case, ``R`` rows,
while a device holds ``T x k`` of them on average. A layer that saves its gate and up
projections for the backward (``model.remat_save: [moe_up]``) keeps only their first
``keep`` rows (``model.moe.saved_rows`` x the mean routed rows, named ``moe_up``), and its
backward runs on those rows alone: the experts' forward is not recomputed, and the
elementwise work covers ``keep`` rows, not ``R``. A device that holds more than ``keep`` rows
in a step (an imbalanced router) takes the other branch of a ``lax.cond``: it recomputes the
whole buffer's forward from ``x``, as a layer without saved projections always does. So the
result is dropless and exact either way; only the cost differs. The fallback runs under the
``KEPT_ROWS_FALLBACK`` name scope, which the plan's count leaves out (an estimate assumes
the routed rows fit; ``plan/flops.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from loomax.models.blocks.remat import name_activation

KEPT_ROWS_FALLBACK = "kept_rows_fallback"
"""Name scope of the backward's recompute when a device holds more rows than it kept."""

Matmul = Callable[[jax.Array, jax.Array], jax.Array]
"""``(rows, weights [G, k, n]) -> rows @ weights`` per group (the groups bound in)."""
MatmulGrads = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
"""``(rows, weights, cotangent) -> (d rows, d weights)`` of a ``Matmul``."""


def expert_ffn(
    x: jax.Array,
    group_sizes: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    mm: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    mm_grads: Callable[..., tuple[jax.Array, jax.Array]],
    act: Callable[[jax.Array], jax.Array],
    keep: int,
) -> jax.Array:
    """``[R, D]``: the experts' gated MLP of the buffer ``x`` (rows grouped by local expert,
    ``group_sizes`` of them). ``mm(x, w, group_sizes)`` is the grouped matmul and
    ``mm_grads(x, w, group_sizes, dy)`` its ``(dx, dw)``; ``act`` the activation. The backward
    uses the first ``keep`` rows of the gate and up projections (see the module docstring)."""
    keep = min(keep, x.shape[0])
    return _ffn(mm, mm_grads, act, keep, x, group_sizes, gate, up, down)


def _forward(mm, act, x, group_sizes, gate, up, down):
    g, u = mm(x, gate, group_sizes), mm(x, up, group_sizes)
    return mm(act(g) * u, down, group_sizes), g, u


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ffn(mm, mm_grads, act, keep, x, group_sizes, gate, up, down):
    return _forward(mm, act, x, group_sizes, gate, up, down)[0]


def _ffn_fwd(mm, mm_grads, act, keep, x, group_sizes, gate, up, down):
    y, g, u = _forward(mm, act, x, group_sizes, gate, up, down)
    kept = name_activation((g[:keep], u[:keep]), "moe_up")
    return y, (x, group_sizes, gate, up, down, kept)


def _ffn_bwd(mm, mm_grads, act, keep, residuals, dy):
    x, group_sizes, gate, up, down, (g, u) = residuals
    rows = x.shape[0]

    def from_kept():
        dx, *dw = _backward(mm_grads, act, x[:keep], group_sizes, gate, up, down, g, u, dy[:keep])
        return (jnp.pad(dx, ((0, rows - keep), (0, 0))), *dw)

    def recompute():
        with jax.named_scope(KEPT_ROWS_FALLBACK):
            _, g_all, u_all = _forward(mm, act, x, group_sizes, gate, up, down)
            return _backward(mm_grads, act, x, group_sizes, gate, up, down, g_all, u_all, dy)

    if keep >= rows:
        grads = from_kept()
    else:
        grads = jax.lax.cond(jnp.sum(group_sizes) <= keep, from_kept, recompute)
    dx, dgate, dup, ddown = grads
    return dx, None, dgate, dup, ddown


def _backward(mm_grads, act, x, group_sizes, gate, up, down, g, u, dy):
    """``(dx, dgate, dup, ddown)`` from the gate and up projections ``g``, ``u`` of ``x``."""
    h, act_vjp = jax.vjp(lambda g, u: act(g) * u, g, u)
    dh, ddown = mm_grads(h, down, group_sizes, dy)
    dg, du = act_vjp(dh)
    dx_gate, dgate = mm_grads(x, gate, group_sizes, dg)
    dx_up, dup = mm_grads(x, up, group_sizes, du)
    return dx_gate + dx_up, dgate, dup, ddown


_ffn.defvjp(_ffn_fwd, _ffn_bwd)
