"""The reward registry: rewards are Python functions registered by name, combined with weights.

A reward is ``fn(prompt, completion, answer) -> float`` (``answer`` the prompt's reference,
or None). ``@register_reward("name")`` adds one; ``rl.rewards`` names them with weights
(``{exact_match: 1.0, format: 0.1}``) and ``combined_reward`` scores a completion by their
weighted sum. The shipped rewards register themselves when
``loomax.rl.rewards`` (the package, imported before this module) is imported. A reward
that raises fails the run with a ``RewardError`` that names it and
the completion, instead of an unexplained crash inside the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from loomax.errors import UserError

RewardFn = Callable[[str, str, "str | None"], float]
"""``fn(prompt, completion, answer) -> float``."""

_REWARDS: dict[str, RewardFn] = {}


class RewardError(UserError):
    """A reward function raised or returned something that is not a finite number."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register ``fn`` under ``name`` (a decorator); a second reward of one name is an error."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"a reward named {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return add


def reward_names() -> list[str]:
    """The registered rewards' names, sorted."""
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``; an unknown name lists the known ones."""
    if name not in _REWARDS:
        raise RewardError(
            f"rl.rewards: no reward named {name!r}; registered: {', '.join(sorted(_REWARDS))}"
        )
    return _REWARDS[name]


def check_rewards(weights: Mapping[str, float]) -> None:
    """Every name in ``weights`` is a registered reward (before any model work)."""
    if not weights:
        raise RewardError("rl.rewards: name at least one reward, e.g. {exact_match: 1.0}")
    for name in weights:
        get_reward(name)


def score(
    weights: Mapping[str, float],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
) -> dict[str, np.ndarray]:
    """Each reward's ``[rows]`` scores by name, and their weighted sum under ``"total"``."""
    out: dict[str, np.ndarray] = {}
    for name in weights:
        fn = get_reward(name)
        values = np.zeros(len(completions), np.float32)
        for i, (prompt, completion, answer) in enumerate(
            zip(prompts, completions, answers, strict=True)
        ):
            try:
                value = float(fn(prompt, completion, answer))
            except Exception as error:  # noqa: BLE001 - named and re-raised
                raise RewardError(
                    f"reward {name!r} raised {type(error).__name__}: {error} "
                    f"(on completion {completion!r} of prompt {prompt!r})"
                ) from error
            if not np.isfinite(value):
                raise RewardError(f"reward {name!r} returned {value} on completion {completion!r}")
            values[i] = value
        out[name] = values
    out["total"] = sum(
        (weights[n] * out[n] for n in weights), np.zeros(len(completions), np.float32)
    ).astype(np.float32)
    return out
