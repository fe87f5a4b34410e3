"""Deterministic mixtures: which dataset, and which of its samples, fills each stream position.

The global sample stream (position ``p = step * batch_size + row``) is cut into blocks
of ``block_size`` positions. In every block, dataset ``d`` gets exactly ``count[d]``
slots (the weights times the block size, rounded by largest remainder), and a seeded
permutation scatters the slots over the block. So the proportions hold in every block,
and position ``p`` maps to ``(dataset, index within that dataset)`` in O(1): block
``b``, slot ``s`` is dataset ``d``'s ``b * count[d] + rank`` -th sample.

Weights may change at given positions (stages); a stage's per-dataset starting counts
are what the earlier stages reserved (whole blocks), computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomax.data.permutation import FeistelPermutation

DEFAULT_BLOCK = 1024


def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Slots per dataset in one block: ``weights`` normalised, largest-remainder rounded."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"mixture weights must be non-negative with a positive sum, got {list(weights)}"
        )
    exact = w / w.sum() * block_size
    counts = np.floor(exact).astype(np.int64)
    short = block_size - counts.sum()
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


@dataclass(frozen=True)
class _Stage:
    start: int  # first stream position of the stage
    counts: np.ndarray  # slots per dataset per block
    consumed: np.ndarray  # samples each dataset gave before the stage


class Mixture:
    """Maps stream positions to ``(dataset, sample index)`` for weighted datasets.

    ``stages`` is ``[(start_position, weights), ...]`` with the first at position 0.
    """

    def __init__(
        self,
        stages: Sequence[tuple[int, Sequence[float]]],
        seed: int,
        block_size: int = DEFAULT_BLOCK,
    ):
        if not stages or stages[0][0] != 0:
            raise ValueError("the first mixture stage must start at position 0")
        starts = [s for s, _ in stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"mixture stages must start at increasing positions, got {starts}")
        self.block_size = block_size
        self.seed = seed
        self.num_datasets = len(stages[0][1])
        built: list[_Stage] = []
        consumed = np.zeros(self.num_datasets, dtype=np.int64)
        for i, (start, weights) in enumerate(stages):
            if len(weights) != self.num_datasets:
                raise ValueError(
                    f"mixture stage {i} has {len(weights)} weights for {self.num_datasets} datasets"
                )
            if built:
                consumed = built[-1].consumed + self._taken(built[-1], start - built[-1].start)
            built.append(_Stage(start, block_counts(weights, block_size), consumed))
        self._stages = built

    def _slots(self, stage_index: int, block: int) -> FeistelPermutation:
        return FeistelPermutation(self.block_size, [self.seed, "mixture", stage_index, block])

    def _taken(self, stage: _Stage, length: int) -> np.ndarray:
        """Samples of each dataset reserved by the first ``length`` positions of ``stage``.

        A block cut short by the next stage still reserves all its samples (its slots
        hand out ranks in scattered order), so no sample is ever used twice.
        """
        return stage.counts * -(-length // self.block_size)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, index within dataset)`` arrays for stream ``positions``."""
        positions = np.asarray(positions, dtype=np.int64)
        datasets = np.empty(positions.shape, dtype=np.int64)
        indices = np.empty(positions.shape, dtype=np.int64)
        starts = np.array([s.start for s in self._stages])
        which = np.searchsorted(starts, positions, side="right") - 1
        for stage_index in np.unique(which):
            stage = self._stages[stage_index]
            mask = which == stage_index
            local = positions[mask] - stage.start
            blocks, slots = np.divmod(local, self.block_size)
            bounds = np.cumsum(stage.counts)
            firsts = bounds - stage.counts
            d = np.empty(local.shape, dtype=np.int64)
            rank = np.empty(local.shape, dtype=np.int64)
            for block in np.unique(blocks):
                in_block = blocks == block
                q = self._slots(int(stage_index), int(block))(slots[in_block])
                dd = np.searchsorted(bounds, q, side="right")
                d[in_block], rank[in_block] = dd, q - firsts[dd]
            datasets[mask] = d
            indices[mask] = stage.consumed[d] + blocks * stage.counts[d] + rank
        return datasets, indices
