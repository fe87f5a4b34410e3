"""Run configurators: a model size -> its budget (tokens), batch, learning rate, schedule, checkpoints."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import draccus


@dataclass(frozen=True)
class RunPlan:
    """What one rung of the ladder trains: numbers the dry run prints and the run uses."""

    params: int
    """Total parameters (embeddings included)."""
    tokens: int
    """Training tokens."""
    batch_size: int
    """Sequences per step."""
    seq_len: int
    num_train_steps: int
    learning_rate: float
    warmup: int
    """Warmup steps."""
    checkpoint_steps: list[int]
    """Steps with a permanent checkpoint (each after a decay with a stepped schedule)."""
    cycles: list[int] | None
    """WSD-S cycle ends (the checkpoint steps), or None for one cosine decay."""
    decay_fraction: float

    @property
    def batch_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def flops(self) -> float:
        """Training compute, 6 N D."""
        return 6.0 * self.params * self.num_train_steps * self.batch_tokens


@dataclass(frozen=True)
class RunConfigurator(draccus.ChoiceRegistry, abc.ABC):
    """Decides a size's training budget and hyperparameters; ``type`` picks the rule."""

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "chinchilla"

    @abc.abstractmethod
    def plan(self, params: int, seq_len: int) -> RunPlan:
        """The run of a model with ``params`` parameters and sequences of ``seq_len``."""


@RunConfigurator.register_subclass("chinchilla")
@dataclass(frozen=True)
class ChinchillaRunConfigurator(RunConfigurator):
    """Chinchilla budgets: ``tokens_per_param * params * chinchilla_multiple`` tokens.

    Batch size and learning rate follow compute C = 6 N D as fitted by DeepSeek LLM
    (B ~ 0.292 C^0.3271 tokens, lr ~ 0.3118 C^-0.125) unless given. Checkpoints fall at
    0.5x, 1x, 2x, 4x ... the Chinchilla budget up to ``chinchilla_multiple``; with
    ``stepped_schedule`` the LR is WSD-S, decaying over the last ``decay_fraction`` of the
    stretch before each checkpoint, so every checkpoint is a fully decayed model.
    """

    chinchilla_multiple: float = 1.0
    """Train for this many times the Chinchilla-optimal tokens."""
    tokens_per_param: float = 20.0
    """Chinchilla-optimal tokens per parameter."""
    decay_fraction: float = 0.1
    """Fraction of each cycle (stepped) or of training spent decaying."""
    lr_multiplier: float = 1.0
    """Multiplies the learning rate."""
    learning_rate: float | None = None
    """Peak learning rate before lr_multiplier; null = from compute (DeepSeek fit)."""
    batch_size_tokens: int | None = None
    """Tokens per step; null = from compute (DeepSeek fit), rounded to a power of two of sequences."""
    min_batch_size: int = 8
    """Fewest sequences per step."""
    warmup_fraction: float = 0.05
    """Warmup as a fraction of the first cycle."""
    stepped_schedule: bool = True
    """WSD-S with a decay before each checkpoint; false = warmup and one cosine decay to the end."""

    def __post_init__(self):
        for name in ("chinchilla_multiple", "tokens_per_param", "lr_multiplier", "min_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ladder.run.{name} must be > 0, got {getattr(self, name)}")
        for name in ("decay_fraction", "warmup_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"ladder.run.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.batch_size_tokens is not None and self.batch_size_tokens <= 0:
            raise ValueError(
                f"ladder.run.batch_size_tokens must be > 0, got {self.batch_size_tokens}"
            )

    def multiples(self) -> list[float]:
        """Chinchilla multiples with a checkpoint: 0.5, 1, 2, 4, ... below the target, then the target."""
        out, m = [], 0.5
        while m < self.chinchilla_multiple - 1e-9:
            out.append(m)
            m *= 2
        return [*out, self.chinchilla_multiple]

    def plan(self, params: int, seq_len: int) -> RunPlan:
        tokens = int(self.chinchilla_multiple * self.tokens_per_param * params)
        compute = 6.0 * params * tokens
        if self.batch_size_tokens is not None:
            batch = max(self.min_batch_size, round(self.batch_size_tokens / seq_len))
        else:
            ideal = 0.292 * compute**0.3271 / seq_len
            batch = max(self.min_batch_size, 2 ** round(math.log2(max(ideal, 1))))
        step_tokens = batch * seq_len
        steps = max(1, math.ceil(tokens / step_tokens))
        earlier = {
            round(m * self.tokens_per_param * params / step_tokens) for m in self.multiples()[:-1]
        }
        checkpoints = sorted({s for s in earlier if 0 < s < steps} | {steps})
        peak = self.learning_rate if self.learning_rate is not None else 0.3118 * compute**-0.125
        first = checkpoints[0] if self.stepped_schedule else steps
        return RunPlan(
            params=params,
            tokens=steps * step_tokens,
            batch_size=batch,
            seq_len=seq_len,
            num_train_steps=steps,
            learning_rate=peak * self.lr_multiplier,
            warmup=max(1, round(self.warmup_fraction * first)) if self.warmup_fraction else 0,
            checkpoint_steps=checkpoints,
            cycles=checkpoints if self.stepped_schedule else None,
            decay_fraction=self.decay_fraction,
        )
