"""The rollout stream's schedule: temporary saves wait for a rollout boundary, a resume inside
a rollout is refused, rows must form whole groups, and the prompts of a rollout are a
seeded per-epoch permutation (the same in a resumed run)."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.checkpoint import CheckpointError
from loomax.rl.config import RlConfig
from loomax.rl.stream import RolloutStream
from loomax.rl.tasks import Prompt


def _stream(**rl):
    prompts = [Prompt(f"p{i}", "a") for i in range(6)]
    return RolloutStream(RlConfig(**rl), prompts, lambda t: [1], lambda ids: "", stop_token=0,
                         seq_len=8, rows_per_step=4, seed=0, mesh=None, jit=None, place=None,
                         cast=None)  # fmt: skip


def test_the_stream_keeps_checkpoints_and_prompts_on_rollout_boundaries():
    stream = _stream(group_size=2, minibatches=2, iterations=2)  # 4 steps, 4 prompts a rollout
    assert [stream.blocks_temporary_saves(s) for s in range(1, 9)] == [True] * 3 + [False] + [
        True
    ] * 3 + [False]
    with pytest.raises(CheckpointError, match="step 5 is inside rollout 1"):
        next(stream.batches(None, 5))
    first, second = stream.prompt_indices(0), stream.prompt_indices(1)
    assert sorted([*first, *second[:2]]) == list(range(6))  # epoch 0: each prompt once
    assert np.array_equal(_stream(group_size=2, minibatches=2).prompt_indices(1), second)
    with pytest.raises(ValueError, match="do not split into groups of rl.group_size = 3"):
        _stream(group_size=3)
