"""Model sizes of a ladder: ``"30M"`` -> a number of parameters -> a transformer shape."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMB]?)\s*$", re.IGNORECASE)


def parse_size(spec: str | int) -> int:
    """``"30M"`` -> 30_000_000 (K, M and B suffixes; a bare number is a parameter count)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec <= 0:
            raise ValueError(f"ladder size must be positive, got {spec}")
        return spec
    match = _SIZE.match(str(spec))
    if not match:
        raise ValueError(f"ladder size must look like 500K, 30M or 1.5B, got {spec!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"ladder size must be positive, got {spec!r}")
    return value


@dataclass(frozen=True)
class Shape:
    """The width, depth and heads of a transformer."""

    hidden_dim: int
    num_layers: int
    num_heads: int

    def non_embedding_params(self) -> int:
        """About 12 d^2 per layer (attention 4 d^2, a 4x MLP 8 d^2)."""
        return 12 * self.num_layers * self.hidden_dim**2


def shape_for(
    target: int, *, aspect_ratio: float = 64.0, head_dim: int = 64, min_layers: int = 2
) -> Shape:
    """A shape with about ``target`` non-embedding parameters and width / depth near ``aspect_ratio``.

    Depth comes from ``12 * L * (aspect_ratio * L)^2 = target``; width is then rounded to a
    multiple of ``head_dim`` (at least one head).
    """
    if target <= 0 or aspect_ratio <= 0 or head_dim <= 0:
        raise ValueError(
            f"shape_for needs positive target, aspect_ratio and head_dim, got {target}, {aspect_ratio}, {head_dim}"
        )
    layers = max(min_layers, round((target / (12 * aspect_ratio**2)) ** (1 / 3)))
    width = math.sqrt(target / (12 * layers))
    hidden = max(head_dim, round(width / head_dim) * head_dim)
    return Shape(hidden, layers, hidden // head_dim)


EMBEDDING_PARTS = ("embed", "lm_head")
"""Top-level model fields whose parameters are embeddings (token, position) or the LM head."""


def non_embedding_params(model_config, vocab_size: int) -> int:
    """Parameters of ``model_config`` outside its embeddings and LM head (counted from
    shapes, nothing allocated): what a ladder size names."""
    import jax

    shapes = jax.eval_shape(lambda: model_config.build(vocab_size, key=jax.random.PRNGKey(0)))
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        top = getattr(path[0], "name", "")
        if hasattr(leaf, "size") and not any(part in top for part in EMBEDDING_PARTS):
            total += leaf.size
    return total
