"""Muon's orthogonalisation of stacks of matrices, split over the devices by whole matrices.

Design (why not a sharded iteration): under FSDP, tensor or expert parallelism a weight rests
split along its matrix dimensions (``embed -> data``, ``mlp -> model``), so every
Newton-Schulz matmul of a matrix taken where it rests needs collectives: the Gram matrix ``X
X^T`` contracts over the split dimension (a partial sum, all-reduced five times per step and
per matrix), or XLA gathers the whole matrix onto every device and every device repeats the
same iteration (the global model's FLOPs on each device). Instead each matrix is gathered
*once*, whole, and each device runs the iteration on its own whole matrices with no
communication at all. The ``layers`` and ``experts`` axes are batch dimensions. A stack with
at least as many matrices as devices (a mixture's expert weights, ``layers x experts`` of
them) is split in place over its own batch dims: ``experts`` stays on ``expert`` where it
rests, the other mesh axes (but ``replica``) go to the batch dims they divide (unevenly,
padded by XLA, where none does), so the matrix dims are gathered within each device's share by
one all-to-all and never a whole stack. The smaller stacks of one matrix shape (``q_proj`` and
``o_proj`` of a few layers) are joined into one batch, padded to a multiple of the devices and
split over every mesh axis but ``replica``. The results go back to where the parameters rest
(XLA's all-to-all). Per device that is about ``matrices / devices`` iterations: the per-device
share of the work, not the global model (never a concatenation of differently laid out large
stacks, which XLA gathers whole: 7.4 TB a chip for Kimi K2's experts). ``replica`` (across
slices, over DCN) is left out: every replica group repeats the work rather than sending
updates across slices. With fewer matrices of a shape than devices, some devices idle for that
shape.

The exact result per matrix is that of one device: each matrix is orthogonalised whole,
by the same program; only where it runs changes.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from loomax.mesh import current_mesh

_NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""The quintic's coefficients (Jordan et al.), pushing singular values into a band around 1."""
PREFERRED_AXES = {"experts": "expert", "layers": "stage"}
"""The mesh axis a named batch dim rests on (``mesh.make_axis_mappings``), kept when split."""
SPLIT_AXES_EXCLUDED = ("replica",)
"""Mesh axes the matrices are not split over (each replica group repeats the work)."""


def newton_schulz(g: jax.Array, steps: int) -> jax.Array:
    """Approximately orthogonalise the last two dims of ``g`` (quintic Newton-Schulz iteration)."""
    wide = g.shape[-2] <= g.shape[-1]
    x = g.astype(jnp.float32)
    x = x if wide else jnp.swapaxes(x, -1, -2)
    x = _iterate(x, steps)
    x = x if wide else jnp.swapaxes(x, -1, -2)
    return x.astype(g.dtype)


def _iterate(x: jax.Array, steps: int) -> jax.Array:
    """The iteration on wide matrices ``[..., m, n]`` with ``m <= n`` (Gram matrices ``m x m``)."""
    a, b, c = _NS_COEFFS
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def split_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a batch of matrices is split over: every axis of more than one device
    but ``replica``."""
    if mesh is None:
        return ()
    return tuple(n for n in mesh.axis_names if mesh.shape[n] > 1 and n not in SPLIT_AXES_EXCLUDED)


def orthogonalize_stacks(
    stacks: list[jax.Array],
    steps: int,
    *,
    split: bool = True,
    batch_names: list[tuple[str, ...]] | None = None,
) -> list[jax.Array]:
    """Orthogonalise every matrix of every ``[*batch, m, n]`` array of ``stacks``.

    With ``split`` and a mesh in context (see the module docstring): a stack of at least as
    many matrices as devices is split in place over its own batch dims (named by
    ``batch_names``: ``experts`` stays on ``expert``, ``layers`` on ``stage``, the other mesh
    axes taken by the batch dims they divide); the smaller stacks whose matrices have the
    same shape (up to a transpose) are joined into one batch, padded to a multiple of the
    devices and split. Returns float32 arrays in the shapes given.
    """
    mesh = current_mesh() if split else None
    axes = split_axes(mesh)
    ways = math.prod(mesh.shape[n] for n in axes) if axes else 1
    names = batch_names or [()] * len(stacks)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    wide = []
    out: list[jax.Array | None] = [None] * len(stacks)
    for i, s in enumerate(stacks):
        w = s.astype(jnp.float32)
        w = w if w.shape[-2] <= w.shape[-1] else jnp.swapaxes(w, -1, -2)
        wide.append(w)
        if ways == 1:
            out[i] = _iterate(w, steps)
        elif math.prod(w.shape[:-2]) >= ways:
            spec = PartitionSpec(*batch_split(w.shape[:-2], names[i], mesh, axes), None, None)
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))
            out[i] = jax.lax.with_sharding_constraint(_iterate(w, steps), spec)
        else:
            groups[w.shape[-2:]].append(i)
    for members in groups.values():
        x = jnp.concatenate([wide[i].reshape(-1, *wide[i].shape[-2:]) for i in members])
        total = x.shape[0]
        x = jnp.pad(x, ((0, -total % ways), (0, 0), (0, 0)))  # zeros stay zeros
        spec = PartitionSpec(axes if len(axes) > 1 else axes[0], None, None)
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        y = _iterate(x, steps)[:total]
        start = 0
        for i in members:
            n = math.prod(wide[i].shape[:-2])
            out[i] = y[start : start + n].reshape(wide[i].shape)
            start += n
    return [
        o if o.shape == s.shape else jnp.swapaxes(o, -1, -2)  # type: ignore[union-attr]
        for o, s in zip(out, stacks, strict=True)
    ]


def batch_split(
    shape: tuple[int, ...], names: tuple[str, ...], mesh, axes: tuple[str, ...]
) -> list[tuple[str, ...] | None]:
    """The mesh axes each batch dim of ``shape`` is split over: a named dim first on its
    preferred axis (where the weights rest), then each other axis, largest first, on the dim
    it divides with the most matrices a device, else (unevenly, XLA pads) on the dim with
    the most, or on none when every dim has at most one matrix a device."""
    placed: list[list[str]] = [[] for _ in shape]
    per_device = list(shape)
    left = list(axes)
    for d, name in enumerate(names):
        axis = PREFERRED_AXES.get(name)
        if axis in left and per_device[d] % mesh.shape[axis] == 0:
            placed[d].append(axis)
            per_device[d] //= mesh.shape[axis]
            left.remove(axis)
    for axis in sorted(left, key=lambda a: -mesh.shape[a]):
        size = mesh.shape[axis]
        even = [d for d in range(len(shape)) if per_device[d] % size == 0]
        d = max(even or range(len(shape)), key=lambda d: per_device[d])
        if per_device[d] <= 1:
            continue  # every device of this axis repeats the work
        placed[d].append(axis)
        per_device[d] = -(-per_device[d] // size)
    return [tuple(p) if p else None for p in placed]
