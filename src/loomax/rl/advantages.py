"""Group-normalised advantages (GRPO), with DAPO's dynamic sampling of groups.

Rows come in groups of ``G`` completions of one prompt (rows ``g·G … g·G + G − 1``). A
row's advantage is its reward minus its group's mean, divided by the group's standard
deviation plus ``1e-4`` (TRL's ``scale_rewards="group"``: the unbiased std) unless
``scale`` is false (Dr. GRPO). A group whose rewards are all equal teaches nothing (every
advantage is 0); ``drop_flat_groups`` (DAPO's dynamic sampling) marks its rows invalid.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-4
"""Added to a group's std before dividing (TRL's value)."""


def group_advantages(
    rewards: np.ndarray, group_size: int, *, scale: bool = True, drop_flat_groups: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, valid)``, both ``[rows]`` float32, from ``[rows]`` rewards."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(centred)
    advantages = centred / (std + EPS) if scale else centred
    valid = np.ones_like(grouped)
    if drop_flat_groups:
        valid = np.broadcast_to(
            grouped.max(axis=1, keepdims=True) > grouped.min(axis=1, keepdims=True), grouped.shape
        ).astype(np.float64)
    return advantages.reshape(-1).astype(np.float32), valid.reshape(-1).astype(np.float32)
