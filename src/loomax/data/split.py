"""Holding out whole documents for validation when no validation sources are given."""

import numpy as np

SPLIT_SEED = 0
"""Seed of the permutation that picks the held-out documents; part of the cache key."""


def held_out_split(
    num_documents: int, fraction: float, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Splits document indices into (train, validation), both sorted.

    `round(fraction * num_documents)` documents, at least one and leaving at least one
    for training, are drawn by a seeded permutation, so the split is the same on every
    run and every machine. Splitting documents (not windows) means no text is in both.
    """
    if num_documents < 2:
        raise ValueError(
            f"cannot hold out validation documents from {num_documents} train document(s); "
            "add more data to `data.train` or give `data.validation` sources"
        )
    num_validation = min(num_documents - 1, max(1, round(fraction * num_documents)))
    order = np.random.default_rng(seed).permutation(num_documents)
    return np.sort(order[num_validation:]), np.sort(order[:num_validation])
