"""Muon's orthogonalisation of stacks of matrices, split over the devices by whole matrices.

Design (why not a sharded iteration): under FSDP, tensor or expert parallelism a weight rests
split along its matrix dimensions (``embed -> data``, ``mlp -> model``), so every
Newton-Schulz matmul of a matrix taken where it rests needs collectives: the Gram matrix
``X X^T`` contracts over the split dimension (a partial sum, all-reduced five times per
step and per matrix), or XLA gathers the whole matrix onto every device and every device
repeats the same iteration (the global model's FLOPs on each device). Instead the updates
are gathered *once*, by matrix: the matrices of one shape (the ``layers`` and ``experts``
axes are batch dimensions, and different parameters of the same shape, e.g. ``q_proj`` and
``o_proj``, join one batch) are stacked, padded to a multiple of the devices and split along
that batch over every mesh axis but ``replica`` (one all-to-all); each device runs the
iteration on its own whole matrices with no communication at all, and the results go back
to where the parameters rest (the second all-to-all, XLA's, from the parameter layout the
update is added to). Per device that is ``ceil(matrices / devices)`` iterations: the
per-device share of the work, not the global model. ``replica`` (across slices, over DCN)
is left out: every replica group repeats the work rather than sending updates across slices.
With fewer matrices of a shape than devices, some devices idle for that shape (the work per
device is still one matrix, never more than one device's whole share).

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
    stacks: list[jax.Array], steps: int, *, split: bool = True
) -> list[jax.Array]:
    """Orthogonalise every matrix of every ``[batch, m, n]`` array of ``stacks``.

    Arrays whose matrices have the same shape (up to a transpose) and dtype are
    orthogonalised as one batch; with ``split`` and a mesh in context that batch is padded
    to a multiple of the devices and split over them, whole matrices per device (see the
    module docstring). Returns float32 arrays in the shapes given.
    """
    mesh = current_mesh() if split else None
    axes = split_axes(mesh)
    ways = math.prod(mesh.shape[n] for n in axes) if axes else 1
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    wide = []
    for i, s in enumerate(stacks):
        w = s.astype(jnp.float32)
        w = w if w.shape[-2] <= w.shape[-1] else jnp.swapaxes(w, -1, -2)
        wide.append(w)
        groups[w.shape[-2:]].append(i)
    out: list[jax.Array | None] = [None] * len(stacks)
    for members in groups.values():
        x = jnp.concatenate([wide[i] for i in members], axis=0)
        total = x.shape[0]
        if ways > 1:
            x = jnp.pad(x, ((0, -total % ways), (0, 0), (0, 0)))  # zeros stay zeros
            spec = PartitionSpec(axes if len(axes) > 1 else axes[0], None, None)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        y = _iterate(x, steps)[:total]
        start = 0
        for i in members:
            n = wide[i].shape[0]
            part = y[start : start + n]
            start += n
            out[i] = part if part.shape == stacks[i].shape else jnp.swapaxes(part, -1, -2)
    return out  # type: ignore[return-value]
