"""The experts' gated MLP over expert parallelism's receive buffer, and its backward pass.

``expert_ffn`` is ``mm(glu(mm(x, gate), mm(x, up)), down)`` (``glu(g, u) = act(g) * u``, or
gpt-oss's clamped SwiGLU; with per-expert ``biases`` on the gate and up projections, each row
its expert's) over a buffer ``x [R, D]`` whose
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
Adapters = tuple[tuple[jax.Array, jax.Array] | None, ...]
"""LoRA on the experts: for the gate, up and down weights each ``(A [G, in, r], B [G, r,
out])`` (B times the adapter's scale) or None; a projection is ``mm(x, w) + mm(mm(x, A), B)``."""
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
    glu: Callable[[jax.Array, jax.Array], jax.Array],
    keep: int,
    biases: tuple[jax.Array, jax.Array] | None = None,
    adapters: Adapters | None = None,
) -> jax.Array:
    """``[R, D]``: the experts' gated MLP of the buffer ``x`` (rows grouped by local expert,
    ``group_sizes`` of them). ``mm(x, w, group_sizes)`` is the grouped matmul and
    ``mm_grads(x, w, group_sizes, dy)`` its ``(dx, dw)``; ``glu(g, u)`` the gated unit;
    ``biases`` the gate's and up's ``[experts, M]`` biases or None. The backward uses the
    first ``keep`` rows of the gate and up projections (see the module docstring).
    ``adapters``: LoRA on the experts (``Adapters``), differentiated by JAX through the
    grouped matmuls (no kept rows: the whole buffer's projections are saved or recomputed)."""
    if adapters is not None:
        return _adapted_forward(mm, glu, x, group_sizes, gate, up, down, biases, adapters)
    keep = min(keep, x.shape[0])
    return _ffn(mm, mm_grads, glu, keep, x, group_sizes, gate, up, down, biases)


def row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each of ``rows`` buffer rows' group (expert); the number of groups past the groups."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _projections(mm, x, group_sizes, gate, up, biases):
    return _biased(mm(x, gate, group_sizes), mm(x, up, group_sizes), group_sizes, biases)


def _biased(g, u, group_sizes, biases):
    if biases is not None:  # rows past the groups take a zero bias (their rows are unread)
        ids = row_experts(group_sizes, g.shape[0])
        g, u = (a + jnp.take(b, ids, axis=0, mode="fill", fill_value=0).astype(a.dtype)
                for a, b in zip((g, u), biases, strict=True))  # fmt: skip
    return g, u


def _adapted_forward(mm, glu, x, group_sizes, gate, up, down, biases, adapters):
    """The forward with low-rank adapters: each weight's grouped matmul plus the two grouped
    matmuls of its adapter, over the same rows and groups (``Adapters``)."""

    def with_adapter(rows, w, sizes, pair):
        out = mm(rows, w, sizes)
        if pair is None:
            return out
        a, b = pair
        return out + mm(mm(rows, a, sizes), b, sizes)

    g_ad, u_ad, d_ad = adapters
    g, u = with_adapter(x, gate, group_sizes, g_ad), with_adapter(x, up, group_sizes, u_ad)
    g, u = _biased(g, u, group_sizes, biases)
    return with_adapter(glu(g, u), down, group_sizes, d_ad)


def _forward(mm, glu, x, group_sizes, gate, up, down, biases):
    g, u = _projections(mm, x, group_sizes, gate, up, biases)
    return mm(glu(g, u), down, group_sizes), g, u


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ffn(mm, mm_grads, glu, keep, x, group_sizes, gate, up, down, biases):
    return _forward(mm, glu, x, group_sizes, gate, up, down, biases)[0]


def _ffn_fwd(mm, mm_grads, glu, keep, x, group_sizes, gate, up, down, biases):
    y, g, u = _forward(mm, glu, x, group_sizes, gate, up, down, biases)
    kept = name_activation((g[:keep], u[:keep]), "moe_up")
    return y, (x, group_sizes, gate, up, down, biases, kept)


def _ffn_bwd(mm, mm_grads, glu, keep, residuals, dy):
    x, group_sizes, gate, up, down, biases, (g, u) = residuals
    rows = x.shape[0]
    weights = (gate, up, down)

    def from_kept():
        dx, *dw, dg, du = _backward(mm_grads, glu, x[:keep], group_sizes, weights, g, u, dy[:keep])
        dx, dg, du = (jnp.pad(a, ((0, rows - keep), (0, 0))) for a in (dx, dg, du))
        return dx, *dw, dg, du

    def recompute():
        with jax.named_scope(KEPT_ROWS_FALLBACK):
            _, g_all, u_all = _forward(mm, glu, x, group_sizes, gate, up, down, biases)
            return _backward(mm_grads, glu, x, group_sizes, weights, g_all, u_all, dy)

    if keep >= rows:
        grads = from_kept()
    else:
        grads = jax.lax.cond(jnp.sum(group_sizes) <= keep, from_kept, recompute)
    dx, dgate, dup, ddown, dg, du = grads
    dbiases = None
    if biases is not None:  # each row's gradient to its expert's bias
        ids = row_experts(group_sizes, dg.shape[0])
        dbiases = tuple(
            jax.ops.segment_sum(d, ids, num_segments=b.shape[0]).astype(b.dtype)
            for d, b in zip((dg, du), biases, strict=True)
        )
    return dx, None, dgate, dup, ddown, dbiases


def _backward(mm_grads, glu, x, group_sizes, weights, g, u, dy):
    """``(dx, dgate, dup, ddown, dg, du)`` from the gate and up projections ``g``, ``u`` of
    ``x`` (``weights``: gate, up, down); ``dg``/``du`` those projections' gradients."""
    gate, up, down = weights
    h, glu_vjp = jax.vjp(glu, g, u)
    dh, ddown = mm_grads(h, down, group_sizes, dy)
    dg, du = glu_vjp(dh)
    dx_gate, dgate = mm_grads(x, gate, group_sizes, dg)
    dx_up, dup = mm_grads(x, up, group_sizes, du)
    return dx_gate + dx_up, dgate, dup, ddown, dg, du


_ffn.defvjp(_ffn_fwd, _ffn_bwd)
