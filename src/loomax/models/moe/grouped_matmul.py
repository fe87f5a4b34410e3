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
- ``blocked`` (CPU, GPU, any backend): each group's rows in tiles of ``block`` rows, and a
  loop over the *occupied* tiles only (its trip count is computed from ``group_sizes`` at
  run time), a few tiles a step in one batched matmul: work = the routed rows + at most
  ``block - 1`` padding rows per group, whatever the buffer's size; memory = one step's
  tiles and gathered weights (``WEIGHT_BYTES_PER_STEP``); the backward (a custom VJP) runs
  the same loop, the weight gradient summed per group in one accumulator. (XLA:CPU lowers
  ``ragged_dot`` by masking ``x`` into ``[G, m, k]`` and contracting over all groups: G
  times the work; it remains the reference the tests compare with.)

A caller whose rows are a fixed-size buffer only partly filled (expert parallelism's receive
buffer) passes ``rows``, the routed rows it holds (the mean over devices): the grouped
matmul runs under a ``routed_rows_scope`` naming them and the buffer's size, so the plan's
count (``plan/flops.py``) charges the kernels whose work follows the groups (megablox's
grid) for the routed rows, not the buffer; the ``blocked`` loop runs under a
``loop_trips=N`` scope, N its expected steps for those rows (the count's loop length).

``auto`` picks by the platform compiled for (the mesh in context, else the default backend,
so ``loomax compile`` for a TPU slice on a CPU host builds what the TPU runs): TPU
``megablox`` inside ``shard_map`` (where the MoE layer runs: each device's own rows, with or
without expert parallelism), ``blocked`` outside it (a Mosaic kernel cannot be partitioned
automatically: XLA refuses it); GPU and CPU ``blocked``.
"""

from __future__ import annotations

import contextlib
import importlib
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loomax.mesh import target_platform

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


def resolve(impl: str, w_shape: tuple[int, ...] | None = None) -> str:
    """The implementation ``impl`` names, ``auto`` resolved for the platform compiled for
    and, given the weights' shape ``[G, k, n]``, for megablox's tiles (``megablox_fits``)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"grouped matmul must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl != "auto":
        return impl
    if target_platform() != "tpu" or not jax.sharding.get_abstract_mesh().manual_axes:
        return "blocked"  # megablox runs per device (shard_map): XLA refuses it outside
    return "megablox" if w_shape is None or megablox_fits(w_shape) else "blocked"


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
    impl = resolve(impl, w.shape)
    group_sizes = group_sizes.astype(jnp.int32)
    with _routed(impl, rows, x.shape[0], w.shape[0]):
        if impl == "ragged_dot":
            acc = jnp.promote_types(x.dtype, jnp.float32)
            out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=acc)
            return out.astype(x.dtype)
        if impl == "megablox":
            return _megablox(x, w, group_sizes, zero_rest)
        return blocked_grouped_matmul(x, w, group_sizes, block, rows)


def megablox_fits(w_shape) -> bool:
    """Whether megablox's tiles fit weights ``[G, k, n]``: each of k and n at most one tile
    (the tile is then the whole dimension) or a multiple of it."""
    return all(d <= MEGABLOX_TILE or d % MEGABLOX_TILE == 0 for d in w_shape[1:])


def _routed(impl: str, rows: int | None, m: int, groups: int):
    """The ``routed_rows`` scope for ``rows`` routed of ``m`` (none when all are)."""
    if rows is None or rows >= m:
        return contextlib.nullcontext()
    if impl == "megablox":  # its grid covers whole row tiles: one partial tile per group
        rows += groups * (MEGABLOX_TILE - 1)
    return routed_rows_scope(rows, m)


WEIGHT_BYTES_PER_STEP = 32 * 2**20
"""Expert weights one step of the ``blocked`` form's loop gathers (its tiles' matrices)."""
LOOP_TRIPS = "loop_trips"
"""Name-scope prefix ``loop_trips=N``: the loop below it runs about N times (for the count)."""


class TileLayout(NamedTuple):
    """Where the rows go when every group is padded to whole tiles of ``block`` rows, the
    tiles taken ``chunk`` at a time by a loop that runs only over the occupied ones.

    ``source [tiles, block]``: the row of ``x`` each slot holds (``valid`` false for
    padding); ``group [tiles]``: each tile's group; ``trips``: the loop steps that hold
    occupied tiles (traced: ``ceil(sum(ceil(group_sizes / block)) / chunk)``), at most
    ``steps``, the static bound ``ceil((ceil(m / block) + G) / chunk)``.
    """

    source: jax.Array
    valid: jax.Array
    group: jax.Array
    trips: jax.Array
    chunk: int
    steps: int

    def step(self, i):
        """``(source, valid, group)`` of loop step ``i``'s ``chunk`` tiles."""
        at = i * self.chunk
        return tuple(
            jax.lax.dynamic_slice_in_dim(a, at, self.chunk)
            for a in (self.source, self.valid, self.group)
        )


ROUTED_STEPS = 8
"""Loop steps the ``blocked`` form aims at for a buffer only partly filled (``rows``): the
last step's unoccupied tiles, at most ``1 / ROUTED_STEPS`` of the routed work, are wasted."""


def tiles_per_step(
    m: int, k: int, n: int, groups: int, block: int, itemsize: int, rows: int | None = None
) -> int:
    """Tiles one loop step takes: as many as keep their gathered ``[k, n]`` weight matrices
    within ``WEIGHT_BYTES_PER_STEP`` (at least one, at most every tile); for a buffer whose
    routed ``rows`` are fewer than its ``m``, also at most ``1 / ROUTED_STEPS`` of the tiles
    those rows are expected to fill, so that the work follows them, not the buffer."""
    tiles = -(-m // block) + groups
    chunk = max(1, min(tiles, WEIGHT_BYTES_PER_STEP // max(1, k * n * itemsize)))
    if rows is not None and rows < m:
        routed = -(-(rows + groups * block // 2) // block)
        chunk = min(chunk, max(1, -(-routed // ROUTED_STEPS)))
    return chunk


def tile_layout(group_sizes: jax.Array, m: int, block: int, chunk: int) -> TileLayout:
    """The ``TileLayout`` of ``m`` rows grouped by ``group_sizes``."""
    G = group_sizes.shape[0]
    steps = -(-(-(-m // block) + G) // chunk)
    tiles = steps * chunk
    per_group = -(-group_sizes // block)
    padded_ends = jnp.cumsum(per_group * block)
    starts = jnp.cumsum(group_sizes) - group_sizes
    slot = jnp.arange(tiles * block, dtype=jnp.int32)
    slot_group = jnp.searchsorted(padded_ends, slot, side="right")
    g = jnp.minimum(slot_group, G - 1)
    offset = slot - (padded_ends - per_group * block)[g]
    valid = (slot_group < G) & (offset < group_sizes[g])
    source = jnp.where(valid, starts[g] + offset, 0).astype(jnp.int32)
    trips = -(-jnp.sum(per_group) // chunk)
    return TileLayout(
        source.reshape(tiles, block),
        valid.reshape(tiles, block),
        g.reshape(tiles, block)[:, 0].astype(jnp.int32),
        trips.astype(jnp.int32),
        chunk,
        steps,
    )


def expected_trips(rows: int, m: int, groups: int, block: int, chunk: int) -> int:
    """Loop steps for ``rows`` routed rows of ``m`` spread over ``groups`` groups: their
    tiles plus half a tile of padding per group (the expectation the plan counts)."""
    tiles = -(-(min(rows, m) + groups * block // 2) // block)
    steps = -(-(-(-m // block) + groups) // chunk)
    return max(1, min(steps, -(-tiles // chunk)))


def _layout(x, w, group_sizes, block: int, rows: int | None) -> tuple[TileLayout, int]:
    m = x.shape[0]
    block = max(1, min(block, m))
    chunk = tiles_per_step(m, w.shape[1], w.shape[2], w.shape[0], block, w.dtype.itemsize, rows)
    return tile_layout(group_sizes.astype(jnp.int32), m, block, chunk), block


def _loop(layout: TileLayout, body, init, rows: int | None, m: int, groups: int, block: int):
    """``body`` over the occupied loop steps, under a ``loop_trips`` scope for the count."""
    trips = expected_trips(m if rows is None else rows, m, groups, block, layout.chunk)
    with jax.named_scope(f"{LOOP_TRIPS}={trips}"):
        return jax.lax.fori_loop(0, layout.trips, body, init)


def _gather_tiles(a: jax.Array, source: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """``a``'s rows at ``source [c, b]`` as ``[c, b, d]`` (zero where not ``valid``), gathered
    as one ``[c*b, d]`` matrix: libtpu's layout assignment rejects the 3-D gather inside the
    loop once the layer's inputs are offloaded to the host ("layout minor_to_major field
    contains 2 elements, but shape has 3 dimensions")."""
    rows = a[source.reshape(-1)]
    if valid is not None:
        rows = jnp.where(valid.reshape(-1, 1), rows, 0)
    return rows.reshape(*source.shape, a.shape[1])


def _tile_products(lhs, w, layout: TileLayout, spec: str, rows, block: int) -> jax.Array:
    """``lhs``'s rows times their group's matrix (``spec``: ``w`` as ``[k, n]`` or
    transposed), tile by tile over the occupied steps; rows outside every group are zero."""
    m = lhs.shape[0]
    n = w.shape[2] if spec.endswith("->cbn") else w.shape[1]
    acc = jnp.promote_types(lhs.dtype, jnp.float32)
    spare = m + jnp.arange(layout.chunk * block, dtype=jnp.int32)  # distinct, out of range

    def body(i, out):
        source, valid, group = layout.step(i)
        tiles = _gather_tiles(lhs, source, valid)
        products = jnp.einsum(spec, tiles, w[group], preferred_element_type=acc)
        where = jnp.where(valid.reshape(-1), source.reshape(-1), spare)
        return out.at[where].set(
            products.reshape(-1, n).astype(lhs.dtype), mode="drop", unique_indices=True
        )

    return _loop(layout, body, jnp.zeros((m, n), lhs.dtype), rows, m, w.shape[0], block)


def _tile_weight_grad(x, dy, layout: TileLayout, groups: int, rows, block: int) -> jax.Array:
    """``[G, k, n]`` float32: each group's ``x[rows]^T dy[rows]``, summed per group as the
    loop goes (one ``[G, k, n]`` accumulator, whatever the number of tiles)."""
    m, k = x.shape
    acc = jnp.promote_types(x.dtype, jnp.float32)

    def body(i, dw):
        source, valid, group = layout.step(i)
        tiles = _gather_tiles(x, source, valid)
        per_tile = jnp.einsum(
            "cbk,cbn->ckn", tiles, _gather_tiles(dy, source), preferred_element_type=acc
        )
        return dw.at[group].add(per_tile)

    init = jnp.zeros((groups, k, dy.shape[1]), acc)
    return _loop(layout, body, init, rows, m, groups, block)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def blocked_grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    block: int = DEFAULT_BLOCK,
    rows: int | None = None,
) -> jax.Array:
    """The ``blocked`` form: each group's rows in tiles of ``block`` rows, a loop over the
    occupied tiles only, a few at a time (``tiles_per_step``: one batched matmul of those
    tiles times their groups' matrices). Work follows the routed rows: their tiles plus at
    most ``block - 1`` padding rows per group, whatever the buffer's size ``m``; memory follows
    one loop step (a step's gathered weights are at most ``WEIGHT_BYTES_PER_STEP``), not the
    tile count. Its backward runs the same loop: ``dx`` against the untransposed weights, the
    weight gradient summed per group in one accumulator. ``rows``: the routed rows expected
    (for the plan's count of the loop; the loop itself runs on ``group_sizes``)."""
    layout, block = _layout(x, w, group_sizes, block, rows)
    return _tile_products(x, w, layout, "cbk,ckn->cbn", rows, block)


def _blocked_fwd(x, w, group_sizes, block, rows):
    return blocked_grouped_matmul(x, w, group_sizes, block, rows), (x, w, group_sizes)


def _blocked_bwd(block, rows, residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = _blocked_grads(x, w, group_sizes, dy, block, rows)
    return dx, dw, None


def _blocked_grads(x, w, group_sizes, dy, block, rows):
    layout, block = _layout(x, w, group_sizes, block, rows)
    dx = _tile_products(dy.astype(x.dtype), w, layout, "cbn,ckn->cbk", rows, block)
    dw = _tile_weight_grad(x, dy.astype(x.dtype), layout, w.shape[0], rows, block)
    return dx, dw.astype(w.dtype)


blocked_grouped_matmul.defvjp(_blocked_fwd, _blocked_bwd)


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
    out = gmm(xp, w, group_sizes, x.dtype, tiling, interpret=target_platform() != "tpu")
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
    impl = resolve(impl, w.shape)
    group_sizes = group_sizes.astype(jnp.int32)
    with _routed(impl, rows, x.shape[0], w.shape[0]):
        if impl == "megablox":
            return _megablox_grads(x, w, group_sizes, dy)
        if impl == "blocked":
            return _blocked_grads(x, w, group_sizes, dy, block, rows)
        _, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes, impl=impl), x, w)
        return vjp(dy)


def _megablox_grads(x, w, group_sizes, dy):
    """megablox's own backward kernels (gmm against the transposed weights, tgmm)."""
    # the module (the package's ``gmm`` attribute is the function with its custom VJP)
    kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    m = x.shape[0]
    pad = (-m) % MEGABLOX_TILE
    xp, dyp = (jnp.pad(a, ((0, pad), (0, 0))) if pad else a for a in (x, dy))
    tile = lambda *dims: tuple(min(MEGABLOX_TILE, d) for d in dims)  # noqa: E731
    tiling = tile(xp.shape[0], x.shape[1], w.shape[2])  # (rows, k, n) of x @ w and of tgmm
    interpret = target_platform() != "tpu"
    # dy [m, n] @ w[g]^T: the contraction is n, the result's columns k
    dx_tiling = tile(xp.shape[0], w.shape[2], w.shape[1])
    dx = kernels.gmm(
        dyp, w, group_sizes, x.dtype, dx_tiling, transpose_rhs=True, interpret=interpret
    )
    dw = kernels.tgmm(
        xp.swapaxes(0, 1), dyp, group_sizes, w.dtype, tiling, num_actual_groups=w.shape[0],
        interpret=interpret,
    )  # fmt: skip
    return dx[:m], dw
