"""Tokens trained on by a step, for throughput: constant batches or a batch-size schedule."""

from __future__ import annotations

from collections.abc import Callable

TokenCount = Callable[[int], int]
"""``tokens(step)``: tokens trained on in steps 1..``step`` (all processes)."""


def token_count(tokens_per_step: int | TokenCount) -> TokenCount:
    """``tokens_per_step`` as a ``TokenCount``; an int means that many tokens every step."""
    if callable(tokens_per_step):
        return tokens_per_step
    per_step = int(tokens_per_step)
    return lambda step: step * per_step


def tokens_of_step(tokens: TokenCount, step: int) -> int:
    """Tokens in step ``step`` alone."""
    return tokens(step) - tokens(step - 1)
