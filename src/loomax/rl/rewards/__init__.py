"""Rewards for RL: a registry (``registry``) and the shipped rewards, one file each:
``exact_match``, ``numeric`` (a number equal to the answer's), ``format_check`` (the
completion matches a pattern), ``code_tests`` (a program passes unit tests, in a subprocess
with a time limit)."""

from loomax.rl.rewards import code_tests, exact_match, format_check, numeric  # noqa: F401
from loomax.rl.rewards.registry import (
    RewardError,
    check_rewards,
    get_reward,
    register_reward,
    reward_names,
    score,
)

__all__ = ["RewardError", "check_rewards", "get_reward", "register_reward", "reward_names", "score"]
