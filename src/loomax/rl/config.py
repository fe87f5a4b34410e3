"""``TrainRlConfig``: the whole run YAML of an RL job (``loomax rl``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import loomax.hooks  # noqa: F401 - registers the hook types `trainer.hooks` may name
from loomax.models import Gpt2Config, LmConfig
from loomax.optim import AdamConfig, OptimizerConfig
from loomax.rl.loss import NORMALISATIONS
from loomax.train import TrainerConfig


def _default_rewards() -> dict[str, float]:
    return {"exact_match": 1.0}


@dataclass(frozen=True)
class RlConfig:
    """The `rl` section: prompts, rollouts, rewards and the GRPO-family loss."""

    train: str | None = None
    """A jsonl file of prompts, one object a line: {prompt, answer} (answer: the reference the rewards check)."""
    validation: str | None = None
    """A jsonl file of held-out prompts (same fields), scored greedily every `trainer.steps_per_eval`; null = none."""
    tokenizer: str | None = None
    """A tokenizer.json (or its folder); null = a byte-level BPE trained on the train prompts and answers, kept in the run dir."""
    tokenizer_vocab_size: int = 300
    """Vocabulary size of the BPE trained when `tokenizer` is null (>= 260)."""
    rewards: dict[str, float] = field(default_factory=_default_rewards)
    """Registered rewards and their weights; the reward is their weighted sum (`loomax.rl.rewards`)."""
    group_size: int = 8
    """G: completions sampled per prompt (a group; advantages are normalised within it)."""
    max_new_tokens: int = 16
    """Most tokens sampled per completion (its stop token, EOS, included)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0); the loss's log-probs use the same."""
    top_p: float | None = None
    """Nucleus sampling of the rollouts: the smallest set of tokens reaching this mass; null = all."""
    loss: str = "grpo"
    """Loss normalisation: grpo (per-sequence mean), dapo (token level), dr_grpo (constant normaliser)."""
    eps_low: float = 0.2
    """Clip range below 1 of the importance ratio (1 - eps_low)."""
    eps_high: float = 0.2
    """Clip range above 1 of the importance ratio (1 + eps_high; DAPO's clip-higher: 0.28)."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the reference (the starting weights; a LoRA run's base); 0 = no reference."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (GRPO, DAPO); false = Dr. GRPO."""
    drop_flat_groups: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are left out of the loss."""
    minibatches: int = 1
    """Optimizer steps per pass over a rollout batch (each on `trainer.train_batch_size` rows)."""
    iterations: int = 1
    """Passes over each rollout batch (μ): steps per rollout = minibatches × iterations."""
    warm_start_steps: int = 0
    """Supervised steps on the train prompts' answers before RL (cross-entropy on the answer tokens); 0 = none."""
    warm_start_learning_rate: float = 3.0e-3
    """Peak learning rate of the warm start (the optimizer's schedule, over its steps)."""
    max_eval_prompts: int | None = None
    """Held-out prompts scored per evaluation; null = all."""

    def __post_init__(self):
        if self.loss not in NORMALISATIONS:
            raise ValueError(
                f"rl.loss must be one of {', '.join(NORMALISATIONS)}, got {self.loss!r}"
            )
        if self.group_size < 2:
            raise ValueError(
                f"rl.group_size must be >= 2 (advantages compare a group), got {self.group_size}"
            )
        if self.temperature <= 0:
            raise ValueError(f"rl.temperature must be > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"rl.top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "minibatches", "iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(
                f"rl.eps_low must be in [0, 1) and rl.eps_high >= 0, got {self.eps_low}, {self.eps_high}"
            )
        if self.kl_beta < 0 or self.warm_start_steps < 0:
            raise ValueError("rl.kl_beta and rl.warm_start_steps must be >= 0")
        if self.tokenizer_vocab_size < 260:
            raise ValueError(
                f"rl.tokenizer_vocab_size must be >= 260, got {self.tokenizer_vocab_size}"
            )

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps trained on each rollout batch."""
        return self.minibatches * self.iterations


@dataclass(frozen=True)
class TrainRlConfig:
    """A whole RL run: prompts, rollouts and loss, model (the policy), optimizer, trainer."""

    rl: RlConfig = field(default_factory=RlConfig)
    """Prompts, rewards, sampling and the GRPO-family loss."""
    model: LmConfig = field(default_factory=Gpt2Config)
    """The policy model; its starting weights: rl.warm_start_steps, trainer.initialize_from_hf or trainer.initialize_from."""
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    """The optimizer and its learning-rate schedule of the RL steps (`type`: adam)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, batch (rollout rows per optimizer step), precision, logging, evaluation and checkpoints."""
