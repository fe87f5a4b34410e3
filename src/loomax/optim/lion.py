"""Lion (Chen et al. 2023): the sign of an interpolated momentum, in the shared chain."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from loomax.optim.config import OptimizerConfig


@OptimizerConfig.register_subclass("lion")
@dataclass(frozen=True)
class LionConfig(OptimizerConfig):
    """Lion: updates are signs, so use a learning rate ~3-10x smaller than AdamW's."""

    beta1: float = 0.9
    """Interpolation between momentum and gradient for the update direction."""
    beta2: float = 0.99
    """Decay of the momentum."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")

    def direction(self) -> optax.GradientTransformation:
        return optax.scale_by_lion(self.beta1, self.beta2)
