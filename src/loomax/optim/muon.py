"""Muon: orthogonalised momentum for the matrices (linear layers, experts), AdamW for the rest.

Under FSDP, tensor and expert parallelism each matrix is orthogonalised whole, the matrices
of one shape split over the devices (``newton_schulz``); which parameters are matrices and
how they are scaled: ``muon_matrices``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optax

from loomax.optim.config import OptimizerConfig
from loomax.optim.muon_matrices import BATCH_AXES, muon_labels, orthogonalize_matrices

__all__ = ["MuonConfig", "muon_labels"]


@OptimizerConfig.register_subclass("muon")
@dataclass(frozen=True)
class MuonConfig(OptimizerConfig):
    """Muon (Jordan et al. 2024) on Linear and expert weights, scaled to AdamW's update RMS; Adam on embeddings, norms, biases and the LM head."""

    momentum: float = 0.95
    """Momentum of the matrix updates."""
    nesterov: bool = True
    """Nesterov momentum for the matrix updates."""
    ns_steps: int = 5
    """Newton-Schulz iterations of the orthogonalisation."""
    beta1: float = 0.9
    """Adam first-moment decay (embeddings, norms, biases)."""
    beta2: float = 0.95
    """Adam second-moment decay (embeddings, norms, biases)."""
    epsilon: float = 1e-8
    """Adam epsilon (embeddings, norms, biases)."""
    update_rms: float = 0.2
    """Matrix updates scaled by update_rms x sqrt(max(rows, cols)) (Moonlight: 0.2 matches AdamW's update RMS)."""
    batch_axes: list[str] = field(default_factory=lambda: list(BATCH_AXES))
    """Axes that index a stack of matrices (stacked layers, experts): batch dims of Newton-Schulz, never part of a matrix."""
    split_newton_schulz: bool = True
    """Split each shape's matrices over the devices, whole (false: every matrix where its shards rest, XLA's choice)."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.update_rms <= 0:
            raise ValueError(f"optimizer.update_rms must be > 0, got {self.update_rms}")
        if self.ns_steps < 1:
            raise ValueError(f"optimizer.ns_steps must be >= 1, got {self.ns_steps}")

    def direction(self) -> optax.GradientTransformation:
        matrices = optax.chain(
            optax.trace(self.momentum, nesterov=self.nesterov),
            orthogonalize_matrices(
                self.ns_steps,
                update_rms=self.update_rms,
                batch_axes=tuple(self.batch_axes),
                split=self.split_newton_schulz,
            ),
        )
        rest = optax.scale_by_adam(self.beta1, self.beta2, self.epsilon)
        axes = tuple(self.batch_axes)
        return optax.multi_transform(
            {"muon": matrices, "adam": rest}, lambda params: muon_labels(params, axes)
        )
