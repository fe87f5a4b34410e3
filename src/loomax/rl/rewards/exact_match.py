"""``exact_match``: 1 when the completion, stripped of surrounding white space, is the answer."""

from __future__ import annotations

from loomax.rl.rewards.registry import register_reward


@register_reward("exact_match")
def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if ``completion.strip() == answer.strip()``, else 0.0 (0.0 without an answer)."""
    if answer is None:
        return 0.0
    return float(completion.strip() == answer.strip())
