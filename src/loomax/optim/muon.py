"""Muon: orthogonalised momentum for the matrices of linear layers, AdamW for everything else."""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import optax

from loomax.optim.config import OptimizerConfig
from loomax.optim.transforms import orthogonalize_linear


@OptimizerConfig.register_subclass("muon")
@dataclass(frozen=True)
class MuonConfig(OptimizerConfig):
    """Muon (Jordan et al. 2024) on Linear weights, scaled to AdamW's update RMS; Adam on the rest."""

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

    def __post_init__(self):
        super().__post_init__()
        for name in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.ns_steps < 1:
            raise ValueError(f"optimizer.ns_steps must be >= 1, got {self.ns_steps}")

    def direction(self) -> optax.GradientTransformation:
        matrices = optax.chain(
            optax.trace(self.momentum, nesterov=self.nesterov),
            orthogonalize_linear(self.ns_steps),
        )
        rest = optax.scale_by_adam(self.beta1, self.beta2, self.epsilon)
        return optax.multi_transform({"muon": matrices, "adam": rest}, muon_labels)


def muon_labels(params):
    """``"muon"`` for Linear weights, ``"adam"`` for every other parameter.

    Labels sit at whole NamedArrays, so masked-out parameters leave no leaf in the state.
    """

    def is_named(x):
        return isinstance(x, hax.NamedArray)

    def mark(node):
        labels = jax.tree.map(lambda _: "adam", node, is_leaf=is_named)
        if isinstance(node, hnn.Linear):
            return eqx.tree_at(lambda m: m.weight, labels, "muon")
        return labels

    return jax.tree.map(mark, params, is_leaf=lambda x: isinstance(x, hnn.Linear) or is_named(x))
