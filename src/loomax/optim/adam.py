"""AdamW: clip, Adam moments, decoupled weight decay on a mask, scheduled learning rate."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from loomax.optim.config import OptimizerConfig
from loomax.optim.mask import weight_decay_mask


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

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon))
        if self.weight_decay > 0:
            mask = lambda params: weight_decay_mask(params, decay_embeddings=self.decay_embeddings)  # noqa: E731
            parts.append(optax.add_decayed_weights(self.weight_decay, mask))
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)
