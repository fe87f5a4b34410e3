"""Candidates measured alternately, round by round, for the CPU comparisons.

On a shared machine the load drifts between runs, so a candidate measured in one block
and another candidate later compare the load, not the code. Here every round runs each
candidate once, in order on even rounds and reversed on odd ones, and the scripts compare
medians over rounds (and ratios within a round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def alternate(
    candidates: Mapping[str, T],
    rounds: int,
    run: Callable[[T], dict],
    rate_key: str,
) -> dict[str, list[dict]]:
    """``{name: [result per round]}`` of ``run(candidates[name])``, alternating as above;
    prints each result's ``rate_key`` (tokens/s, or FAILED) and the load as it goes."""
    runs: dict[str, list[dict]] = {name: [] for name in candidates}
    width = max(map(len, candidates), default=0) + 2
    for rnd in range(rounds):
        order = list(candidates) if rnd % 2 == 0 else list(reversed(candidates))
        for name in order:
            result = run(candidates[name])
            runs[name].append(result)
            rate = result.get(rate_key, "FAILED")
            print(
                f"round {rnd + 1} {name:<{width}} {rate} tokens/s  load {result['load']}",
                flush=True,
            )
    return runs
