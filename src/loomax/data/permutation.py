"""A seeded pseudo-random permutation of ``range(n)``, evaluated index by index in O(1).

A balanced Feistel network over the smallest even-bit-width power of two that holds
``n``, with cycle walking (apply again while the value is ``>= n``): a bijection on
``range(n)`` that needs no table, so shuffling billions of windows costs no memory and
position ``i`` of the shuffled order is computed directly (no replay on resume).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing bijection on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def seed_words(*parts: int | str) -> int:
    """A 64-bit key from any mix of ints and strings (stable across runs and machines)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class FeistelPermutation:
    """``perm(i)`` for ``i`` in ``range(n)`` (ints or numpy arrays), a bijection fixed by ``key``."""

    def __init__(self, n: int, key: int | Sequence[int | str]):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half = bits // 2
        self._mask = np.uint64((1 << self._half) - 1)
        base = key if isinstance(key, int) else seed_words(*key)
        self._keys = [np.uint64(seed_words(base, r)) for r in range(_ROUNDS)]

    def _once(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << half) | right

    def __call__(self, index):
        i = np.asarray(index, dtype=np.int64)
        if i.size and (i.min() < 0 or i.max() >= self.n):
            raise IndexError(f"permutation index out of range [0, {self.n})")
        x = self._once(i.astype(np.uint64))
        outside = x >= self.n
        while outside.any():  # cycle walking: at most a few rounds, the domain is < 4n
            x[outside] = self._once(x[outside])
            outside = x >= self.n
        out = x.astype(np.int64)
        return int(out) if np.ndim(index) == 0 else out
