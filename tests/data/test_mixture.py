"""Mixtures: exact proportions per block, O(1) position lookup, weight changes at steps."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.data.mixture import Mixture, block_counts


def test_block_counts_round_by_largest_remainder():
    assert block_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
    assert block_counts([0.7, 0.2, 0.1], 1024).sum() == 1024
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        block_counts([0, 0], 8)


def test_proportions_over_10k_samples_within_2_percent():
    weights = [0.6, 0.3, 0.1]
    datasets, _ = Mixture([(0, weights)], seed=0)(np.arange(10_000))
    shares = np.bincount(datasets, minlength=3) / 10_000
    np.testing.assert_allclose(shares, weights, atol=0.02)


def test_each_dataset_sample_is_used_once_in_order():
    datasets, indices = Mixture([(0, [0.5, 0.25, 0.25])], seed=3, block_size=64)(np.arange(640))
    for d in range(3):
        assert sorted(indices[datasets == d].tolist()) == list(range(int((datasets == d).sum())))


def test_any_position_alone_equals_the_whole_stream():
    mixture = Mixture([(0, [2, 1]), (300, [1, 3])], seed=5, block_size=128)
    all_d, all_i = mixture(np.arange(1000))
    for p in [0, 127, 128, 299, 300, 301, 555, 999]:
        d, i = mixture(np.array([p]))
        assert (d[0], i[0]) == (all_d[p], all_i[p])


def test_weights_change_at_a_stage_and_counts_continue():
    mixture = Mixture([(0, [1, 0]), (256, [0, 1])], seed=1, block_size=64)
    datasets, indices = mixture(np.arange(512))
    assert (datasets[:256] == 0).all() and (datasets[256:] == 1).all()
    assert indices[:256].tolist() == sorted(indices[:256].tolist()) or set(indices[:256]) == set(
        range(256)
    )
    assert set(indices[256:].tolist()) == set(range(256))
    mixed = Mixture([(0, [1, 1]), (100, [1, 3])], seed=2, block_size=64)
    d, i = mixed(np.arange(2000))
    for k in range(2):  # samples of each dataset stay unique across the stage boundary
        assert len(set(i[d == k].tolist())) == int((d == k).sum())
