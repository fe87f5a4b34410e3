"""Normalisation layers shared by the models: LayerNorm (GPT-2) and RMSNorm (Llama, QK-norm)."""

from __future__ import annotations

import haliax.nn as hnn
from haliax import Axis

Norm = hnn.LayerNorm | hnn.RmsNorm


def layer_norm(axis: Axis, eps: float, *, use_bias: bool = True) -> hnn.LayerNorm:
    """Mean-centred, variance-scaled, with a learned scale (and bias), over ``axis``."""
    return hnn.LayerNorm.init(axis, eps=eps, use_bias=use_bias)


def rms_norm(axis: Axis | tuple[Axis, ...], eps: float, *, use_weight: bool = True) -> hnn.RmsNorm:
    """Scaled by the root mean square over ``axis`` (in float32), then a learned scale
    (none without ``use_weight``); no bias."""
    return hnn.RmsNorm.init(axis, eps=eps, use_weight=use_weight, use_bias=False)
