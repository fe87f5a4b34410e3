"""AdamW: Adam moments (optionally Nesterov) in the shared chain of clipping, decay and schedule."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from loomax.optim.config import OptimizerConfig


@OptimizerConfig.register_subclass("adam")
@dataclass(frozen=True)
class AdamConfig(OptimizerConfig):
    """AdamW (Loshchilov & Hutter) as an optax chain."""

    beta1: float = 0.9
    """Decay of the first-moment estimate."""
    beta2: float = 0.95
    """Decay of the second-moment estimate."""
    epsilon: float = 1e-8
    """Added to the denominator for numerical stability."""
    nesterov: bool = False
    """Use Nesterov momentum in the first moment (NAdamW)."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.epsilon <= 0:
            raise ValueError(f"optimizer.epsilon must be > 0, got {self.epsilon}")

    def direction(self) -> optax.GradientTransformation:
        return optax.scale_by_adam(self.beta1, self.beta2, self.epsilon, nesterov=self.nesterov)
