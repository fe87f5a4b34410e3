"""``format``: 1 when the completion is a space-separated list of single lowercase letters,
the answer format of the shipped tasks (``format_reward(pattern)`` makes one for any regex)."""

from __future__ import annotations

import re

from loomax.rl.rewards.registry import RewardFn, register_reward

LETTER_LIST = r"\s*[a-z](?: [a-z])*\s*"
"""The shipped tasks' answer format: `` a d h``."""


def format_reward(pattern: str) -> RewardFn:
    """A reward of 1.0 when the whole completion matches ``pattern``, else 0.0."""
    compiled = re.compile(pattern)

    def reward(prompt: str, completion: str, answer: str | None) -> float:
        return float(compiled.fullmatch(completion) is not None)

    return reward


register_reward("format")(format_reward(LETTER_LIST))
