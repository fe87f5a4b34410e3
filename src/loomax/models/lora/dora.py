"""DoRA (Liu et al. 2024): a weight-decomposed low-rank adapter's magnitude and direction.

With ``model.lora.dora`` an adapted linear layer's weight is split into a direction,
``W + scale * B A`` divided by its norm per output unit (over the input axes), and a learned
magnitude ``m`` per output unit (``lora_m``: the weight's axes less its input axes), which
starts at the base weight's norm, so that the first step's layer is the base:

    y = (m / ||W + scale B A||) * (W x + scale * B (A dropout(x))) + bias

The norm is held constant in the backward pass (``stop_gradient``), as the paper's section
4.3 suggests and PEFT does (``use_dora``), so a step's gradients are PEFT's too. Merging
gives ``W' = m (W + scale B A) / ||W + scale B A||``.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

MAGNITUDE = "lora_m"
"""A DoRA adapter's magnitude array inside a ``LoraLinear``."""


def norm_per_output(weight: NamedArray, In) -> NamedArray:
    """``weight``'s L2 norm over its input axes ``In`` (float32): one per output unit."""
    ins = (In,) if isinstance(In, hax.Axis) else tuple(In)
    return hax.sqrt(hax.sum(hax.square(weight.astype(jnp.float32)), axis=ins))


def ratio(magnitude: NamedArray, adapted_weight: NamedArray, In) -> NamedArray:
    """``m / ||W + scale B A||`` (the norm a constant to the gradient), float32."""
    norm = norm_per_output(adapted_weight, In)
    norm = hax.named(jax.lax.stop_gradient(norm.array), norm.axes)
    return magnitude.astype(jnp.float32) / norm
