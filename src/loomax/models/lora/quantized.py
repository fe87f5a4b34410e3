"""A frozen weight stored quantised in blocks (QLoRA's base), dequantised where it is used.

``quantize(weight, kind, block)`` cuts the weight along one of its input axes into blocks of
``block`` entries and keeps, per block, its largest magnitude (the scale) and each entry as
a small code relative to it:

- ``int8``: ``round(127 x / absmax)``, one byte an entry;
- ``nf4``: the nearest of the 16 NormalFloat levels (Dettmers et al. 2023: quantiles of a
  standard normal, normalised to [-1, 1], with an exact 0), two entries a byte.

The codes keep the weight's named axes (the packed nf4 codes: the blocked axis halved) and
the scales the blocked axis counted in blocks, under the same names, so FSDP and tensor
parallelism split them by the same axis mappings as the weight. ``BlockQuantized.dequantize``
rebuilds the weight in a given dtype: inside a layer's matmul, so a step holds one layer's
dequantised weight at a time (and recomputes it in the backward pass under remat).

Why not a library: qwix (Google's JAX quantisation library) quantises Flax modules' matmuls
by intercepting them; Loomax's layers are Haliax/Equinox modules with named axes, and what
QLoRA needs of it, a frozen blockwise store and its dequantisation, is this module.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

KINDS = ("none", "int8", "nf4")
"""``model.lora.quantize_base`` choices."""


def nf4_levels() -> np.ndarray:
    """The 16 NormalFloat4 levels, ascending: 8 positive and 7 negative quantiles of N(0, 1)
    (at evenly spaced probabilities from 0.5 to ``offset``, the paper's choice that keeps the
    outermost finite), 0, all divided by the largest."""
    offset = 0.9677083
    inv = NormalDist().inv_cdf
    positive = [inv(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-inv(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    levels = np.sort(np.asarray([*positive, 0.0, *negative]))
    return (levels / levels.max()).astype(np.float32)


class BlockQuantized(eqx.Module):
    """A weight's codes and per-block scales (module docstring); frozen: the codes are
    integers (no gradient), the scales are left out of training by ``model.lora``'s freeze."""

    codes: NamedArray  # int8 (int8) or uint8, two codes a byte (nf4); the weight's axes
    scales: NamedArray  # float32, the blocked axis counted in blocks
    axis: str = eqx.field(static=True)  # the blocked axis
    block: int = eqx.field(static=True)
    kind: str = eqx.field(static=True)

    def dequantize(self, dtype=jnp.float32) -> NamedArray:
        """The weight (its axes, ``dtype``), as nearly as the codes hold it (a scanned
        stack's slice too: the axes are the codes' own)."""
        names = tuple(a.name for a in self.codes.axes)
        at = names.index(self.axis)
        codes = self.codes.array
        if self.kind == "nf4":  # two codes a byte, along the blocked axis: low nibble first
            pairs = jnp.stack([codes & 0xF, codes >> 4], axis=at + 1)
            codes = pairs.reshape(*codes.shape[:at], -1, *codes.shape[at + 1 :])
            values = jnp.asarray(nf4_levels())[codes.astype(jnp.int32)]
        else:
            values = codes.astype(jnp.float32)
        shape = values.shape
        blocked = values.reshape(*shape[:at], shape[at] // self.block, self.block, *shape[at + 1 :])
        scales = self.scales.rearrange(names).array.astype(jnp.float32)
        out = (blocked * jnp.expand_dims(scales, at + 1)).reshape(shape)
        axes = tuple(a if a.name != self.axis else Axis(a.name, shape[at]) for a in self.codes.axes)
        return hax.named(out.astype(dtype), axes)

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes and scales."""
        return sum(x.array.size * x.array.dtype.itemsize for x in (self.codes, self.scales))


def block_size(size: int, block: int) -> int:
    """The block used along an axis of ``size``: ``block``, or the largest divisor of
    ``size`` below it (an even one for nf4's byte pairs where ``size`` allows)."""
    return math.gcd(size, block)


def quantize(weight: NamedArray, In, kind: str, block: int) -> BlockQuantized:
    """``weight`` stored as ``kind`` (int8 | nf4) in blocks of ``block`` entries along its
    last input axis (of ``In``)."""
    ins = (In,) if isinstance(In, Axis) else tuple(In)
    axis = ins[-1]
    size = block_size(axis.size, block)
    if kind == "nf4" and size % 2:
        raise ValueError(
            f"model.lora.quantize_base nf4 packs two codes a byte: {axis.name} ({axis.size}) "
            f"gives blocks of {size} entries; use quantize_base int8 or an even quantize_block"
        )
    names = tuple(a.name for a in weight.axes)
    at = names.index(axis.name)
    x = weight.array.astype(jnp.float32)
    shape = x.shape
    blocked = x.reshape(*shape[:at], shape[at] // size, size, *shape[at + 1 :])
    absmax = jnp.max(jnp.abs(blocked), axis=at + 1, keepdims=True)
    absmax = jnp.where(absmax == 0, 1.0, absmax)
    if kind == "int8":
        codes = jnp.clip(jnp.round(blocked / absmax * 127), -127, 127).astype(jnp.int8)
        codes, scales = codes.reshape(shape), absmax / 127
    elif kind == "nf4":
        levels = jnp.asarray(nf4_levels())
        nearest = jnp.argmin(jnp.abs((blocked / absmax)[..., None] - levels), axis=-1)
        nearest = nearest.reshape(shape).astype(jnp.uint8)
        pairs = nearest.reshape(*shape[:at], shape[at] // 2, 2, *shape[at + 1 :])
        low, high = (jnp.take(pairs, i, axis=at + 1) for i in (0, 1))
        codes, scales = (low | (high << 4)).astype(jnp.uint8), absmax
    else:
        raise ValueError(f"model.lora.quantize_base must be one of {KINDS[1:]}, got {kind!r}")
    code_axes = tuple(
        a if a.name != axis.name else Axis(a.name, codes.shape[at]) for a in weight.axes
    )
    scale_axes = tuple(
        a if a.name != axis.name else Axis(a.name, shape[at] // size) for a in weight.axes
    )
    return BlockQuantized(
        hax.named(codes, code_axes),
        hax.named(jnp.squeeze(scales, at + 1), scale_axes),
        axis.name,
        size,
        kind,
    )


__all__ = ["KINDS", "BlockQuantized", "block_size", "nf4_levels", "quantize"]
