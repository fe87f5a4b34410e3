"""Batch size as a function of the step: ``trainer.train_batch_size`` as an int or stages.

``[{start: 0, value: 256}, {start: 1000, value: 512}]`` means 256 sequences per step for
steps 0-999 and 512 from step 1000 on. The data stream position of step ``k`` (the
offset of its first sequence) is the sum of the batch sizes of the steps before it,
computed in O(number of stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # jax only where a traced step is asked for: the data loader needs none
    import jax.numpy as jnp


@dataclass(frozen=True)
class BatchStage:
    """One stage of a batch-size schedule."""

    start: int = 0
    """First step of this stage."""
    value: int = 32
    """Sequences per optimizer step from `start` on."""


class BatchSchedule:
    """Piecewise-constant batch sizes: ``size_at(step)``, ``offset(step)`` and the stages."""

    def __init__(self, spec: int | Sequence[BatchStage], name: str = "trainer.train_batch_size"):
        stages = [BatchStage(0, spec)] if isinstance(spec, int) else list(spec)
        if not stages:
            raise ValueError(f"{name} must be a positive int or a non-empty list of stages")
        if stages[0].start != 0:
            raise ValueError(f"{name}: the first stage must start at step 0, got {stages[0].start}")
        for a, b in zip(stages, stages[1:], strict=False):
            if b.start <= a.start:
                raise ValueError(
                    f"{name}: stage starts must increase, got {a.start} then {b.start}"
                )
        for s in stages:
            if isinstance(s.value, bool) or not isinstance(s.value, int) or s.value <= 0:
                raise ValueError(f"{name}: batch sizes must be positive ints, got {s.value!r}")
        self.stages = stages
        self.starts = [s.start for s in stages]
        self.sizes = [s.value for s in stages]
        # offsets[i]: sequences consumed before stage i starts
        self.offsets = [0]
        for (a, n), b in zip(
            zip(self.starts, self.sizes, strict=True), self.starts[1:], strict=False
        ):
            self.offsets.append(self.offsets[-1] + (b - a) * n)

    @property
    def is_constant(self) -> bool:
        return len(set(self.sizes)) == 1

    def _stage(self, step: int) -> int:
        i = 0
        while i + 1 < len(self.starts) and self.starts[i + 1] <= step:
            i += 1
        return i

    def size_at(self, step: int) -> int:
        """Sequences in the batch of step ``step``."""
        return self.sizes[self._stage(step)]

    def offset(self, step: int) -> int:
        """Stream position of the first sequence of step ``step``: the sum of earlier batch sizes."""
        i = self._stage(step)
        return self.offsets[i] + (step - self.starts[i]) * self.sizes[i]

    def step_of_offset(self, offset: int) -> int:
        """The step whose batch starts at ``offset`` (the inverse of ``offset``)."""
        i = max(j for j, o in enumerate(self.offsets) if o <= offset)
        step, rem = divmod(offset - self.offsets[i], self.sizes[i])
        if rem:
            raise ValueError(f"stream position {offset} is not the start of a step's batch")
        return self.starts[i] + step

    def traced_size(self, step) -> jnp.ndarray:
        """``size_at`` for a traced step (inside jit), as float32."""
        import jax.numpy as jnp

        step = jnp.asarray(step)
        out = jnp.asarray(self.sizes[0], jnp.float32)
        for start, size in zip(self.starts[1:], self.sizes[1:], strict=True):
            out = jnp.where(step >= start, jnp.float32(size), out)
        return out

    def max_size(self) -> int:
        return max(self.sizes)
