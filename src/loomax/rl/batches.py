"""A rollout batch made ready to train on: response masks, rewards, advantages, old log-probs.

``rollout_arrays`` turns sampled rows into the arrays the loss reads (``rl.loss.grpo_loss``):
``tokens``; ``mask``, 1 at position ``t`` when token ``t + 1`` was sampled (the completion,
its stop token included) and the row's group is kept; ``advantages``; ``old_logp`` and
``ref_logp``, the log-probs of the sampling policy and of the reference, computed by the
loss's own forward pass (so the importance ratio of the first step on a rollout is exactly 1).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loomax.rl.advantages import group_advantages
from loomax.rl.loss import token_logps
from loomax.rl.rollout import Rollouts


def response_mask(rollouts: Rollouts) -> np.ndarray:
    """``[rows, seq_len]`` float32: 1 at the positions predicting a sampled token."""
    t = np.arange(rollouts.tokens.shape[1])[None, :]
    start, end = rollouts.prompt_len[:, None] - 1, rollouts.length[:, None] - 1
    return ((t >= start) & (t < end)).astype(np.float32)


def forward_logps(
    model, tokens: np.ndarray, rows: int, *, temperature: float, jit, place: Callable
) -> np.ndarray:
    """``[rows, seq_len]`` token log-probs of ``model`` (``loss.token_logps``), ``rows`` at a time."""
    fn = _jitted_logps(jit, temperature)
    out = [np.asarray(fn(model, place(tokens[i : i + rows]))) for i in range(0, len(tokens), rows)]
    return np.concatenate(out)


_CACHE: dict = {}


def _jitted_logps(jit, temperature):
    key = (id(jit), temperature)
    if key not in _CACHE:
        _CACHE[key] = jit(
            lambda model, tokens: token_logps(model, tokens, temperature=temperature)[0]
        )
    return _CACHE[key]


def rollout_arrays(
    rollouts: Rollouts,
    rewards: np.ndarray,
    group_size: int,
    *,
    scale_rewards: bool,
    drop_flat_groups: bool,
) -> dict[str, np.ndarray]:
    """``tokens``, ``mask`` (kept groups only), ``advantages`` and ``valid`` of a rollout batch."""
    advantages, valid = group_advantages(
        rewards, group_size, scale=scale_rewards, drop_flat_groups=drop_flat_groups
    )
    return {
        "tokens": rollouts.tokens,
        "mask": response_mask(rollouts) * valid[:, None],
        "advantages": advantages,
        "valid": valid,
    }


def minibatch(arrays: dict[str, np.ndarray], index: int, rows: int) -> dict[str, np.ndarray]:
    """Rows ``index · rows`` to ``(index + 1) · rows`` of each array the loss reads."""
    keys = ("tokens", "mask", "advantages", "old_logp", "ref_logp")
    return {k: arrays[k][index * rows : (index + 1) * rows] for k in keys if k in arrays}


__all__ = ["forward_logps", "minibatch", "response_mask", "rollout_arrays"]
