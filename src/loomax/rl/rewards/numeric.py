"""``numeric``: 1 when the last number in the completion equals the answer's number.

Loomax's own parse (integers, decimals, fractions ``a/b``, thousands commas), not
math-verify: math-verify pulls in sympy and a LaTeX parser, more than the tiny tasks here
need. Numbers compare as exact fractions, so ``0.5``, ``1/2`` and ``2/4`` are equal.
"""

from __future__ import annotations

import re
from fractions import Fraction

from loomax.rl.rewards.registry import register_reward

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+)?|-?\.\d+")
"""An integer, a decimal or a fraction, possibly negative, possibly with thousands commas."""


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text``, as an exact fraction (None if there is none)."""
    found = NUMBER.findall(text)
    if not found:
        return None
    token = found[-1].replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(token)
    except ValueError:
        return None


@register_reward("numeric")
def numeric(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the completion's last number equals the answer's, else 0.0."""
    if answer is None:
        return 0.0
    want, got = last_number(answer), last_number(completion)
    return float(want is not None and got is not None and want == got)
