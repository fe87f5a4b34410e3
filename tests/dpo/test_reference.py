"""The reference log-probs: computed once, read back from the cache (a resumed run's only
source), recomputed when the pairs change."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.checkpoint.serialize import CheckpointError
from loomax.dpo.pairs import PairArrays
from loomax.dpo.reference import reference_logps


def _sets(first_token: int = 1):
    tokens = np.full((3, 4), first_token, np.int32)
    mask = np.ones((3, 4), np.float32)
    return {"train": PairArrays(tokens, mask, tokens + 1, mask)}


def test_the_reference_pass_runs_once_and_a_resumed_run_reads_its_cache(tmp_path):
    path = tmp_path / "ref.npz"
    calls = []

    def compute():
        calls.append(1)
        return {"train/chosen": np.arange(3.0), "train/rejected": -np.arange(3.0)}

    first = reference_logps(path, _sets(), compute)
    again = reference_logps(path, _sets(), None)  # resumed: no reference model at hand
    assert len(calls) == 1
    np.testing.assert_array_equal(again["train/chosen"], first["train/chosen"])
    reference_logps(path, _sets(first_token=2), compute)  # other pairs: the cache is not theirs
    assert len(calls) == 2
    with pytest.raises(CheckpointError, match="dpo.reference_cache"):
        reference_logps(path, _sets(first_token=3), None)
