"""Held-out scoring of the policy: greedy completions of the validation prompts, rewarded.

``RlEvalHook`` answers the trainer's evaluations (``trainer.steps_per_eval``,
``trainer.eval_at_start``, and once after the last step) with ``eval/rl/exact_match`` (the
fraction of completions equal to the answer) and ``eval/rl/reward`` (the mean reward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from loomax.mesh import data_parallel_size
from loomax.rl.config import RlConfig
from loomax.rl.rewards import score
from loomax.rl.rewards.exact_match import exact_match
from loomax.rl.rollout import generate, row_keys
from loomax.rl.tasks import Prompt
from loomax.train.hooks import Hook, StepInfo


def held_out_scores(
    model,
    config: RlConfig,
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    stop_token: int,
    seq_len: int,
    mesh=None,
) -> dict[str, float]:
    """``eval/rl/exact_match`` and ``eval/rl/reward`` of greedy completions of ``prompts``."""
    tokens = [encode(p.prompt) for p in prompts]
    dp = 1 if mesh is None else data_parallel_size(mesh)
    pad = -len(tokens) % dp
    rolled = generate(
        model,
        tokens + tokens[:1] * pad,
        row_keys(jax.random.PRNGKey(0), len(tokens) + pad),
        seq_len=seq_len,
        max_new_tokens=config.max_new_tokens,
        temperature=0.0,
        stop_token=stop_token,
        mesh=mesh,
    )
    completions = []
    for i in range(len(tokens)):
        ids = rolled.completion(i)
        completions.append(decode(ids[:-1] if ids and ids[-1] == stop_token else ids))
    answers = [p.answer for p in prompts]
    exact = np.array([exact_match("", c, a) for c, a in zip(completions, answers, strict=True)])
    rewards = score(config.rewards, [p.prompt for p in prompts], completions, answers)["total"]
    return {"eval/rl/exact_match": float(exact.mean()), "eval/rl/reward": float(rewards.mean())}


class RlEvalHook(Hook):
    """Scores held-out prompts when the trainer evaluates; asks for an evaluation every
    ``steps_per_eval`` steps, at the start (``eval_at_start``) and after the last step."""

    def __init__(
        self,
        score_model: Callable[[Any], dict[str, float]],
        steps_per_eval: int | None,
        at_start: bool,
    ):
        super().__init__()
        self.score_model, self.steps_per_eval, self.at_start = score_model, steps_per_eval, at_start
        self.every = 1
        self.history: list[tuple[int, dict[str, float]]] = []

    def on_train_begin(self, info: StepInfo) -> None:
        if self.at_start and info.step == 0:
            info.control.eval(by="RlEvalHook")

    def on_step(self, info: StepInfo) -> None:
        if self.steps_per_eval and info.step % self.steps_per_eval == 0:
            info.control.eval(by="RlEvalHook")

    def on_train_end(self, info: StepInfo) -> None:
        if not self.history or self.history[-1][0] != info.step:
            info.control.eval(by="RlEvalHook")

    def run_eval(self, info: StepInfo) -> dict[str, float]:
        results = self.score_model(info.state.model)
        self.history.append((info.step, results))
        return results
