"""Adafactor (Shazeer & Stern 2018): factored second moments, in the shared chain."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from loomax.optim.config import OptimizerConfig
from loomax.optim.transforms import on_raw_arrays


@OptimizerConfig.register_subclass("adafactor")
@dataclass(frozen=True)
class AdafactorConfig(OptimizerConfig):
    """Adafactor: row and column second-moment statistics instead of a full matrix.

    The factored statistics are plain arrays (they lose axis names), so they are replicated.
    """

    decay_rate: float = 0.8
    """Exponent of the second-moment decay schedule (1 - step^-decay_rate)."""
    factored: bool = True
    """Factor the second moment of matrices (false = full Adam-like second moment)."""
    min_dim_size_to_factor: int = 128
    """Only factor dimensions at least this large."""
    clipping_threshold: float | None = 1.0
    """Clip each parameter's update to this root-mean-square (Adafactor's own clipping); null = off."""
    momentum: float | None = None
    """First-moment decay (beta1); null = no momentum, as in the paper."""
    epsilon: float = 1e-30
    """Added to squared gradients."""

    def __post_init__(self):
        super().__post_init__()
        if self.decay_rate <= 0:
            raise ValueError(f"optimizer.decay_rate must be > 0, got {self.decay_rate}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"optimizer.momentum must be in [0, 1) or null, got {self.momentum}")
        if self.clipping_threshold is not None and self.clipping_threshold <= 0:
            raise ValueError(
                f"optimizer.clipping_threshold must be > 0 or null, got {self.clipping_threshold}"
            )

    def direction(self) -> optax.GradientTransformation:
        parts = [
            on_raw_arrays(
                optax.scale_by_factored_rms(
                    factored=self.factored,
                    decay_rate=self.decay_rate,
                    min_dim_size_to_factor=self.min_dim_size_to_factor,
                    epsilon=self.epsilon,
                )
            )
        ]
        if self.clipping_threshold is not None:
            parts.append(optax.clip_by_block_rms(self.clipping_threshold))
        if self.momentum is not None:
            parts.append(optax.ema(self.momentum, debias=False))
        return optax.chain(*parts)
