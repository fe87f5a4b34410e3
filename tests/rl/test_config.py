"""The `rl` section refuses bad values naming the key, and the shipped config parses."""

from __future__ import annotations

import pytest

from loomax.config import parse_config
from loomax.rl.config import RlConfig, TrainRlConfig


@pytest.mark.parametrize(
    "values,key",
    [
        ({"loss": "ppo"}, "rl.loss"),
        ({"group_size": 1}, "rl.group_size"),
        ({"temperature": 0.0}, "rl.temperature"),
        ({"minibatches": 0}, "rl.minibatches"),
        ({"top_p": 1.5}, "rl.top_p"),
    ],  # fmt: skip
)
def test_bad_values_name_their_key(values, key):
    with pytest.raises(ValueError, match=key):
        RlConfig(**values)


def test_the_shipped_config_parses(repo_root):
    config = parse_config(TrainRlConfig, repo_root / "config" / "rl_tiny.yaml")
    assert config.rl.rewards == {"exact_match": 1.0} and config.rl.steps_per_rollout == 2
