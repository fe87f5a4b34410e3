from loomax.rl.rewards.format_check import format_reward
from loomax.rl.rewards.registry import get_reward


def test_format_accepts_letter_lists_only():
    fmt = get_reward("format")
    assert fmt("p", " a d h", None) == 1.0
    assert fmt("p", " a dd h", None) == 0.0 and fmt("p", "", None) == 0.0
    assert format_reward(r"\d+")("p", "42", None) == 1.0
