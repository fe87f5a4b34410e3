"""The reward registry: weighted sums, unknown names listed, and a reward that raises named."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.rl.rewards import RewardError, check_rewards, register_reward, reward_names, score


def test_rewards_combine_by_weight_and_a_raising_reward_is_named():
    assert {"exact_match", "numeric", "format", "code_tests"} <= set(reward_names())
    out = score({"exact_match": 1.0, "format": 0.5}, ["p", "p"], [" a b", "A"], [" a b", " a"])
    np.testing.assert_array_equal(out["total"], [1.5, 0.0])
    with pytest.raises(RewardError, match="no reward named 'exact'.*exact_match"):
        check_rewards({"exact": 1.0})

    @register_reward("test_boom")
    def boom(prompt, completion, answer):
        raise ZeroDivisionError("division by zero")

    with pytest.raises(RewardError, match="reward 'test_boom' raised ZeroDivisionError.*'xyz'"):
        score({"test_boom": 1.0}, ["p"], ["xyz"], [None])
