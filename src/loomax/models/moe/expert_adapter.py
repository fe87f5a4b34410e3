"""A low-rank adapter on a stacked expert weight: one (A, B) pair per expert (LoRA on experts).

An expert weight ``W [experts, In, Out]`` (``MoeMlp.gate``/``up``/``down``) gets ``lora_a``
(``experts, lora_r, In``) and ``lora_b`` (``experts, Out, lora_r``), with the weight's other
axes in front (``layers`` in a stack of blocks, sliced per layer by the scan), laid out as a
``LoraLinear``'s adapter batched over the expert axis. Expert ``e``'s projection of a row is
``x W_e + scale * (x A_e^T) B_e^T``: the low-rank product runs as two grouped matmuls over
the same rows and groups as the weight's (``expert_ffn``), so it does only the routed work,
on whichever grouped matmul the layer uses, and under expert parallelism each device holds
the adapters of its own experts (the ``experts`` axis maps to ``expert`` as the weight's does;
``lora_r`` is never sharded). B starts at zero: a fresh adapter leaves the layer's outputs as
they were. The surgery that adds, merges and drops these is ``models/lora/experts.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
from haliax import NamedArray

from loomax.models.axes import Experts

RANK = "lora_r"
"""The adapters' rank axis (as ``models/lora/linear.py``'s)."""


class ExpertAdapter(eqx.Module):
    """Per-expert low-rank factors of one expert weight (module docstring)."""

    lora_a: NamedArray | None
    lora_b: NamedArray | None
    In: str = eqx.field(static=True)
    Out: str = eqx.field(static=True)
    scale: float = eqx.field(static=True, default=1.0)

    def factors(self, dtype=None) -> tuple[jax.Array, jax.Array]:
        """``(A [experts, In, r], B [experts, r, Out] * scale)``: the two grouped matmuls'
        weights (of one layer: the arrays must hold no other axes), in ``dtype``."""
        a = self.lora_a.rearrange((Experts, self.In, RANK)).array
        b = self.lora_b.rearrange((Experts, RANK, self.Out)).array * self.scale
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
        return a, b

    def delta(self, weight: NamedArray) -> NamedArray:
        """``scale * A^T B^T`` per expert, laid out as ``weight`` (what merging adds to it)."""
        product = self.lora_a.dot(self.lora_b, axis=RANK) * self.scale
        return product.rearrange(weight.axes).astype(weight.dtype)


def adapted_weight(weight: NamedArray, adapter: ExpertAdapter | None) -> NamedArray:
    """``weight`` with ``adapter``'s product added (``weight`` itself when None)."""
    if adapter is None or adapter.lora_a is None:
        return weight
    return (weight + adapter.delta(weight)).astype(weight.dtype)


__all__ = ["RANK", "ExpertAdapter", "adapted_weight"]
