"""Epochs: passes over the training data, counted in the sequences the steps have drawn.

Step ``s`` (from 1) trains on stream positions ``[offset(s - 1), offset(s))`` of the batch
schedule; epoch ``e`` (from 0) is positions ``[e * size, (e + 1) * size)``, and a step
belongs to the epoch of its first sequence. Epochs follow from the step alone, so a
resumed run is in the same epoch, reading the same order (the loader's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loomax.batch_schedule import BatchSchedule


@dataclass(frozen=True)
class Epochs:
    """Epoch boundaries of a run whose epoch is ``size`` sequences."""

    size: int
    schedule: BatchSchedule

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"an epoch must hold at least one sequence, got {self.size}")

    def of_step(self, step: int) -> int:
        """The epoch (from 0) of the first sequence of step ``step`` (from 1)."""
        return self.schedule.offset(max(step, 1) - 1) // self.size

    def begins_at(self, step: int) -> bool:
        """Whether step ``step`` is the first of its epoch."""
        return step == 1 or self.of_step(step) > self.of_step(step - 1)

    def ends_at(self, step: int) -> bool:
        """Whether step ``step`` is the last of its epoch (the next step is in a later one)."""
        return self.of_step(step + 1) > self.of_step(step)

    def steps_for(self, epochs: float) -> int:
        """The fewest steps that train on ``epochs`` epochs of sequences (at least one)."""
        target = math.ceil(epochs * self.size)
        low, high = 1, 1
        while self.schedule.offset(high) < target:
            low, high = high, high * 2
        while low < high:  # the first step whose batch ends at or past the target
            mid = (low + high) // 2
            if self.schedule.offset(mid) >= target:
                high = mid
            else:
                low = mid + 1
        return high
