"""The training stream of pairs: every pair once per epoch, resumable at any step."""

from __future__ import annotations

import itertools

import numpy as np

from loomax.batch_schedule import BatchSchedule
from loomax.dpo.data import train_batches
from loomax.dpo.pairs import PairArrays


def test_batches_cover_each_pair_once_an_epoch_and_resume_where_they_were():
    n = 10
    tokens = np.arange(n, dtype=np.int32)[:, None].repeat(3, 1)
    arrays = PairArrays(tokens, np.ones((n, 3), np.float32), tokens, np.ones((n, 3), np.float32))
    reference = {"train/chosen": np.arange(n, dtype=np.float32), "train/rejected": np.zeros(n)}

    def stream(start):
        return train_batches(arrays, reference, BatchSchedule(5), seed=1, start_step=start)

    batches = list(itertools.islice(stream(0), 6))
    for epoch in range(3):
        ids = np.concatenate([b["chosen"][:, 0] for b in batches[2 * epoch : 2 * epoch + 2]])
        assert sorted(ids) == list(range(n))
    assert not np.array_equal(batches[0]["chosen"], batches[2]["chosen"])  # reshuffled
    np.testing.assert_array_equal(batches[0]["ref_chosen"], batches[0]["chosen"][:, 0])
    resumed = next(stream(3))
    for key in batches[3]:
        np.testing.assert_array_equal(resumed[key], batches[3][key])
