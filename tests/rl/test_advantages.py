"""Group advantages: TRL's formula (unbiased group std + 1e-4), Dr. GRPO's unscaled one, and
DAPO's dynamic sampling leaving out groups whose rewards are all equal."""

from __future__ import annotations

import numpy as np

from loomax.rl.advantages import group_advantages


def test_advantages_are_normalised_within_groups():
    rewards = np.array([1, 0, 0, 1, 0.5, 0.0, 1.0, 0.0, 1, 1, 1, 1], np.float32)
    adv, valid = group_advantages(rewards, 4)
    groups = rewards.reshape(3, 4)
    want = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-6)
    assert valid.tolist() == [1.0] * 12
    plain, _ = group_advantages(rewards, 4, scale=False)
    np.testing.assert_allclose(
        plain, (groups - groups.mean(1, keepdims=True)).reshape(-1), rtol=1e-6
    )
    _, kept = group_advantages(rewards, 4, drop_flat_groups=True)
    assert kept.tolist() == [1.0] * 4 + [1.0] * 4 + [0.0] * 4
