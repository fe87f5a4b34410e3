"""Feistel permutations: bijective on range(n), seeded, O(1) per index."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.data.permutation import FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_is_a_permutation(n):
    values = FeistelPermutation(n, [0, "test"])(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))


def test_keys_give_different_orders_and_same_key_the_same():
    a = FeistelPermutation(1000, [1])(np.arange(1000))
    b = FeistelPermutation(1000, [2])(np.arange(1000))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, FeistelPermutation(1000, [1])(np.arange(1000)))
    assert np.mean(a == np.arange(1000)) < 0.05  # actually shuffled


def test_single_indices_without_materialising():
    perm = FeistelPermutation(10**12, [7])
    values = perm(np.array([0, 1, 10**12 - 1]))
    assert values.max() < 10**12 and len(set(values.tolist())) == 3
    assert perm(5) == int(perm(np.array([5]))[0])
    with pytest.raises(IndexError):
        perm(10**12)
