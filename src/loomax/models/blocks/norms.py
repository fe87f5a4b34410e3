"""Normalisation layers shared by the models: LayerNorm (GPT-2), RMSNorm (Llama, QK-norm) and
Gemma's RMSNorm with a ``1 + weight`` scale."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
from haliax import Axis, NamedArray

Norm = hnn.LayerNorm | hnn.RmsNorm


def layer_norm(axis: Axis, eps: float, *, use_bias: bool = True) -> hnn.LayerNorm:
    """Mean-centred, variance-scaled, with a learned scale (and bias), over ``axis``."""
    return hnn.LayerNorm.init(axis, eps=eps, use_bias=use_bias)


def rms_norm(axis: Axis | tuple[Axis, ...], eps: float, *, use_weight: bool = True) -> hnn.RmsNorm:
    """Scaled by the root mean square over ``axis`` (in float32), then a learned scale
    (none without ``use_weight``); no bias."""
    return hnn.RmsNorm.init(axis, eps=eps, use_weight=use_weight, use_bias=False)


class OffsetRmsNorm(eqx.Module):
    """RMSNorm scaled by ``1 + weight`` (weight initialised to zero), computed in float32 and
    cast back to the input's dtype, as Gemma's ``Gemma2RMSNorm``."""

    weight: NamedArray
    axis: Axis | tuple[Axis, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    @staticmethod
    def init(axis: Axis | tuple[Axis, ...], eps: float) -> OffsetRmsNorm:
        return OffsetRmsNorm(hax.zeros(axis), axis, eps)

    def __call__(self, x: NamedArray) -> NamedArray:
        xf = x.astype(jnp.float32)
        mean_square = hax.mean(hax.square(xf), axis=self.axis)
        out = xf * hax.rsqrt(mean_square + self.eps) * (1.0 + self.weight.astype(jnp.float32))
        return out.astype(x.dtype)
