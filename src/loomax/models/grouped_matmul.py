"""Grouped matmul: rows sorted by group, each group times its own weight matrix.

``grouped_matmul(x, w, group_sizes)`` is ``x[rows of g] @ w[g]`` for every group ``g``
(``x`` is ``[m, k]`` with the rows of group 0 first, then group 1, ...; ``w`` is ``[G, k,
n]``), the experts' matmul of a mixture-of-experts layer. Rows past ``sum(group_sizes)``
come out as zeros (``megablox`` may leave them as they are, for a caller that never reads
them: ``zero_rest``). Every implementation does only the routed work:

- ``ragged_dot``: ``jax.lax.ragged_dot``, lowered to ``chlo.ragged_dot``. JAX 0.10's XLA
  compiles it, on GPU as on CPU, to a dense product over every group (the compiled H100 HLO,
  ``tests/plan/test_gpus.py``): G times the routed work and a ``[G, m, k]`` temporary, so
  ``auto`` does not pick it;
- ``megablox`` (TPU): the Pallas ``gmm`` kernel, rows padded to its row tile;
- ``blocked`` (CPU, any backend): each group's rows padded to a multiple of ``block``
  rows, the expert weights of every block gathered, one batched matmul over the blocks:
  work = routed rows + at most ``block - 1`` padding rows per group. (XLA:CPU lowers
  ``ragged_dot`` by masking ``x`` into ``[G, m, k]`` and contracting over all groups: G
  times the work; it remains the reference the tests compare with.)

A caller whose rows are a fixed-size buffer only partly filled (expert parallelism's receive
buffer) passes ``rows``, the routed rows it holds (the mean over devices): the grouped
matmul runs under a ``routed_rows_scope`` naming them and the buffer's size, so the plan's
count (``plan/flops.py``) charges the kernels whose work follows the groups (megablox's
grid) for the routed rows, not the buffer.

``auto`` picks by the platform compiled for (the mesh in context, else the default backend,
so ``loomax compile`` for a TPU slice on a CPU host builds what the TPU runs): TPU
``megablox`` inside ``shard_map`` (expert parallelism), ``blocked`` outside it (a Mosaic
kernel cannot be partitioned automatically: XLA refuses it); GPU and CPU ``blocked``.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp

from loomax.models.splash import mesh_platform

IMPLEMENTATIONS = ("auto", "blocked", "ragged_dot", "megablox")
"""The values of ``model.moe.matmul``."""
DEFAULT_BLOCK = 64
"""Rows per block of the ``blocked`` form."""
MEGABLOX_TILE = 128
"""Row, contraction and output tile of the megablox kernel (each dimension a multiple of it)."""
ROUTED_ROWS = "routed_rows"
"""Name-scope prefix ``routed_rows=R/M``: R of the M rows below it are routed (``rows=``)."""


def routed_rows_scope(rows: int, of: int):
    """A name scope telling the plan's count that ``rows`` of the ``of`` rows are routed."""
    return jax.named_scope(f"{ROUTED_ROWS}={min(rows, of)}/{of}")


def resolve(impl: str) -> str:
    """The implementation ``impl`` names, ``auto`` resolved for the platform compiled for."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"grouped matmul must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = mesh_platform()
    if platform == "tpu" and not jax.sharding.get_abstract_mesh().manual_axes:
        return "blocked"  # megablox must run per device (shard_map); XLA refuses it outside
    return "megablox" if platform == "tpu" else "blocked"


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str = "auto",
    block: int = DEFAULT_BLOCK,
    rows: int | None = None,
    zero_rest: bool = True,
) -> jax.Array:
    """``[m, k]`` rows (sorted by group) times ``w [G, k, n]`` per group -> ``[m, n]``
    in ``x``'s dtype (accumulated in at least float32). ``rows``: how many of the ``m``
    rows the groups hold on average, when fewer (see the module docstring). ``zero_rest``
    false lets ``megablox`` leave the rows past the groups as the kernel left them (any
    values: for a caller that never reads them, sparing a pass over the whole buffer)."""
    impl = resolve(impl)
    group_sizes = group_sizes.astype(jnp.int32)
    with _routed(impl, rows, x.shape[0], w.shape[0]):
        if impl == "ragged_dot":
            acc = jnp.promote_types(x.dtype, jnp.float32)
            out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=acc)
            return out.astype(x.dtype)
        if impl == "megablox":
            return _megablox(x, w, group_sizes, zero_rest)
        return blocked_grouped_matmul(x, w, group_sizes, block)


def _routed(impl: str, rows: int | None, m: int, groups: int):
    """The ``routed_rows`` scope for ``rows`` routed of ``m`` (none when all are)."""
    if rows is None or rows >= m:
        return contextlib.nullcontext()
    if impl == "megablox":  # its grid covers whole row tiles: one partial tile per group
        rows += groups * (MEGABLOX_TILE - 1)
    return routed_rows_scope(rows, m)


def block_layout(group_sizes: jax.Array, m: int, block: int):
    """Where each row goes when every group is padded to a multiple of ``block`` rows.

    Returns ``(num_blocks, source, valid, block_group, dest, in_groups)``: ``source [num_blocks *
    block]`` the row of ``x`` each padded slot holds (``valid`` false for padding),
    ``block_group [num_blocks]`` each block's group, ``dest [m]`` each row's padded slot
    (``in_groups`` false for rows past ``sum(group_sizes)``, which come out as zeros).
    ``num_blocks = ceil(m / block) + G`` bounds the padded row count statically.
    """
    G = group_sizes.shape[0]
    num_blocks = -(-m // block) + G
    padded = -(-group_sizes // block) * block
    ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded)
    starts, padded_starts = ends - group_sizes, padded_ends - padded
    slot = jnp.arange(num_blocks * block, dtype=jnp.int32)
    slot_group = jnp.searchsorted(padded_ends, slot, side="right")
    g = jnp.minimum(slot_group, G - 1)
    offset = slot - padded_starts[g]
    valid = (slot_group < G) & (offset < group_sizes[g])
    source = jnp.where(valid, starts[g] + offset, 0)
    block_group = g.reshape(num_blocks, block)[:, 0]
    row = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), G - 1)
    dest = padded_starts[row_group] + row - starts[row_group]
    in_groups = row < ends[-1]
    return num_blocks, source, valid, block_group, jnp.where(in_groups, dest, 0), in_groups


def blocked_grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int = DEFAULT_BLOCK
) -> jax.Array:
    """The ``blocked`` form: one batched matmul over ``block``-row blocks, each block
    times its group's weights (gathered). Differentiable by ordinary autodiff: the
    gathers transpose to scatter-adds, so the weight gradient is summed per group."""
    m, k = x.shape
    block = max(1, min(block, m))
    num_blocks, source, valid, block_group, dest, in_groups = block_layout(group_sizes, m, block)
    xb = jnp.where(valid[:, None], x[source], 0).reshape(num_blocks, block, k)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    yb = jnp.einsum("bik,bkn->bin", xb, w[block_group], preferred_element_type=acc)
    y = yb.reshape(num_blocks * block, -1)[dest]
    return jnp.where(in_groups[:, None], y, 0).astype(x.dtype)


def _megablox(x: jax.Array, w: jax.Array, group_sizes: jax.Array, zero_rest: bool) -> jax.Array:
    """The TPU Pallas kernel (interpreted off TPU, for tests); rows padded to its tile.
    The kernel leaves rows outside every group unwritten: they are zeroed here if
    ``zero_rest``."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m = x.shape[0]
    pad = (-m) % MEGABLOX_TILE
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    # the kernel accumulates each tile in float32 (its VMEM scratch) whatever it writes: an
    # output in x's dtype halves the bytes of the [buffer rows, mlp] results and their
    # cotangents (the compiled Mixtral v5p step: 8.08 -> 6.53 TB a chip by XLA's count)
    tiling = tuple(min(MEGABLOX_TILE, d) for d in (xp.shape[0], x.shape[1], w.shape[2]))
    out = gmm(xp, w, group_sizes, x.dtype, tiling, interpret=mesh_platform() != "tpu")
    if not zero_rest:
        return out[:m]
    in_groups = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(in_groups[:, None], out[:m], 0)


def grouped_matmul_grads(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    dy: jax.Array,
    *,
    impl: str = "auto",
    block: int = DEFAULT_BLOCK,
    rows: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(dx, dw)`` of ``grouped_matmul(x, w, group_sizes)`` for the cotangent ``dy``, with
    no forward product (a backward written by hand calls this: ``jax.vjp`` would also run the
    forward kernel). Rows of ``dx`` past the groups may hold any values (``zero_rest=False``)."""
    impl = resolve(impl)
    group_sizes = group_sizes.astype(jnp.int32)
    with _routed(impl, rows, x.shape[0], w.shape[0]):
        if impl == "megablox":
            return _megablox_grads(x, w, group_sizes, dy)
        if impl == "blocked":
            dx = blocked_grouped_matmul(dy, w.swapaxes(1, 2), group_sizes, block)
            return dx, _blocked_weight_grad(x, dy, group_sizes, w.shape[0], block).astype(w.dtype)
        _, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes, impl=impl), x, w)
        return vjp(dy)


def _blocked_weight_grad(x, dy, group_sizes, groups: int, block: int) -> jax.Array:
    """``[G, k, n]``: each group's ``x[rows]^T dy[rows]``, one batched matmul over blocks."""
    m, k = x.shape
    block = max(1, min(block, m))
    num_blocks, source, valid, block_group, _, _ = block_layout(group_sizes, m, block)
    xb = jnp.where(valid[:, None], x[source], 0).reshape(num_blocks, block, k)
    dyb = jnp.where(valid[:, None], dy[source], 0).reshape(num_blocks, block, -1)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    per_block = jnp.einsum("bik,bin->bkn", xb, dyb, preferred_element_type=acc)
    return jax.ops.segment_sum(per_block, block_group, num_segments=groups)


def _megablox_grads(x, w, group_sizes, dy):
    """megablox's own backward kernels (gmm against the transposed weights, tgmm)."""
    # the module (the package's ``gmm`` attribute is the function with its custom VJP)
    kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    m = x.shape[0]
    pad = (-m) % MEGABLOX_TILE
    xp, dyp = (jnp.pad(a, ((0, pad), (0, 0))) if pad else a for a in (x, dy))
    tiling = tuple(min(MEGABLOX_TILE, d) for d in (xp.shape[0], x.shape[1], w.shape[2]))
    interpret = mesh_platform() != "tpu"
    dx = kernels.gmm(dyp, w, group_sizes, x.dtype, tiling, transpose_rhs=True, interpret=interpret)
    dw = kernels.tgmm(
        xp.swapaxes(0, 1), dyp, group_sizes, w.dtype, tiling, num_actual_groups=w.shape[0],
        interpret=interpret,
    )  # fmt: skip
    return dx[:m], dw
