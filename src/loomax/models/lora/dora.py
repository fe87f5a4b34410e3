"""DoRA (Liu et al. 2024): a weight-decomposed low-rank adapter's magnitude and direction.

With ``model.lora.dora`` an adapted linear layer's weight is split into a direction,
``W + scale * B A`` divided by its norm per output unit (over the input axes), and a learned
magnitude ``m`` per output unit, so that

    y = (m / ||W + scale B A||) * (W x + scale * B (A dropout(x))) + bias

computed as PEFT does, ``W x + (ratio - 1) W x + ratio * scale * B A x``, ``ratio - 1``
itself computed from the norms' difference (``excess``). The layer keeps
``m - ||W||`` (``lora_m``: the weight's axes less its input axes), which starts at zero:
the first step's ``ratio - 1`` is then exactly 0 and the layer exactly the base
(``excess``; a magnitude stored as ``||W||`` itself, computed once outside the step,
differs from the step's own norm in the last bits).
The norms are held constant in the backward pass (``stop_gradient``), as the paper's
section 4.3 suggests and PEFT does (``use_dora``). Merging gives ``W' = ratio (W + scale
B A)``; the PEFT export writes ``m`` itself (``lora_magnitude_vector``).
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

PAIR = "dora_pair"
"""The axis stacking the base and adapted weights for one reduction of both."""


def norm_per_output(weight: NamedArray, In) -> NamedArray:
    """``weight``'s L2 norm over its input axes ``In`` (float32): one per output unit."""
    ins = (In,) if isinstance(In, hax.Axis) else tuple(In)
    return hax.sqrt(hax.sum(hax.square(weight.astype(jnp.float32)), axis=ins))


def norms(weight: NamedArray, adapted: NamedArray, In) -> tuple[NamedArray, NamedArray]:
    """``(||W||, ||W + scale B A||)`` per output unit, from one reduction, constant to the
    gradient."""
    pair = hax.stack(PAIR, [weight.astype(jnp.float32), adapted.astype(jnp.float32)])
    both = norm_per_output(pair, In)
    both = hax.named(jax.lax.stop_gradient(both.array), both.axes)
    return both[PAIR, 0], both[PAIR, 1]


def magnitude(offset: NamedArray, weight: NamedArray, In) -> NamedArray:
    """The magnitude ``m = ||W|| + offset`` (float32; PEFT's ``lora_magnitude_vector``)."""
    return norm_per_output(weight, In) + offset.astype(jnp.float32)


def excess(offset: NamedArray, weight: NamedArray, delta: NamedArray, In) -> NamedArray:
    """``m / ||W + delta|| - 1`` with ``m = ||W|| + offset`` (float32), computed as
    ``(||W|| - ||W + delta|| + offset) / ||W + delta||``, the norms' difference taken as 0
    on the output units whose ``delta`` row is 0 (where it is 0 in exact arithmetic, while a
    compiled step may sum the two norms in different orders), so that a fresh adapter's
    layer is the base exactly."""
    weight = weight.astype(jnp.float32)
    base, new = norms(weight, weight + delta.astype(jnp.float32), In)
    ins = (In,) if isinstance(In, hax.Axis) else tuple(In)
    unchanged = hax.all(delta == 0, axis=ins)
    gap = hax.where(unchanged, hax.zeros_like(base), base - new)
    return (gap + offset.astype(jnp.float32)) / new
