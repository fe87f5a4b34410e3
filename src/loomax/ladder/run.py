"""Run configurators: a model size -> its budget (tokens), batch, learning rate, schedule, checkpoints."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import draccus


@dataclass(frozen=True)
class RunPlan:
    """What one rung of the ladder trains: numbers the dry run prints and the run uses."""

    params: int
    """Total parameters (embeddings included)."""
    budget_params: int
    """Parameters the budget and compute count (non-embedding by default, as sizes are named)."""
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
    checkpoint_names: list[str] = field(default_factory=list)
    """Name of each checkpoint step: its multiple of the Chinchilla budget ("0.5xC", "1xC"...)."""
    cycle_peaks: list[float] | None = None
    """Peak LR of each WSD-S stage as a multiple of learning_rate (stepped_peak_lr), or None."""

    @property
    def batch_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def flops(self) -> float:
        """Training compute, 6 N D (N = ``budget_params``)."""
        return 6.0 * self.budget_params * self.num_train_steps * self.batch_tokens

    def checkpoint_name(self, step: int) -> str:
        """``step``'s name ("1xC"), or "" for a step the plan did not name."""
        names = dict(zip(self.checkpoint_steps, self.checkpoint_names, strict=False))
        return names.get(step, "")


@dataclass(frozen=True)
class RunConfigurator(draccus.ChoiceRegistry, abc.ABC):
    """Decides a size's training budget and hyperparameters; ``type`` picks the rule."""

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "chinchilla"

    @abc.abstractmethod
    def plan(self, params: int, seq_len: int, non_embedding_params: int | None = None) -> RunPlan:
        """The run of a model with ``params`` parameters (``non_embedding_params`` of them
        outside the embeddings and LM head) and sequences of ``seq_len``."""


@RunConfigurator.register_subclass("chinchilla")
@dataclass(frozen=True)
class ChinchillaRunConfigurator(RunConfigurator):
    """Chinchilla budgets: ``tokens_per_param * N * chinchilla_multiple`` tokens, N the
    non-embedding parameters (``budget_params``).

    Batch size and learning rate follow compute C = 6 N D as fitted by DeepSeek LLM
    (B ~ 0.292 C^0.3271 tokens, lr ~ 0.3118 C^-0.125) unless given. Checkpoints fall at
    0.5x, 1x, 2x, 4x ... the Chinchilla budget up to ``chinchilla_multiple`` (named
    "0.5xC", "1xC"...); with ``wsd_s`` the LR is WSD-S, decaying over the last
    ``decay_fraction`` of the stretch before each checkpoint, so every checkpoint is a fully
    decayed model. ``stepped_peak_lr`` (OLMo's stepped peak) lowers each stage's peak by
    ``1/sqrt`` of its data: ``peak * sqrt(D_first / D_stage)``.
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
    wsd_s: bool = True
    """WSD-S with a decay before each checkpoint; false = warmup and one cosine decay to the end."""
    stepped_peak_lr: bool = False
    """OLMo's stepped peak (needs wsd_s): each stage's peak LR is peak x sqrt(D_first / D_stage)."""
    budget_params: str = "non_embedding"
    """What N of the budget counts: non_embedding (embeddings and LM head left out) or total."""
    stepped_schedule: bool | None = None
    """Renamed wsd_s in 2026-11 (stepped now means OLMo's stepped peak LR); setting it is an error."""

    def __post_init__(self):
        if self.stepped_schedule is not None:
            raise ValueError(
                "ladder.run.stepped_schedule was renamed ladder.run.wsd_s (a decay before each "
                "checkpoint); ladder.run.stepped_peak_lr is OLMo's stepped peak learning rate"
            )
        if self.budget_params not in ("non_embedding", "total"):
            raise ValueError(
                "ladder.run.budget_params must be non_embedding or total, "
                f"got {self.budget_params!r}"
            )
        if self.stepped_peak_lr and not self.wsd_s:
            raise ValueError("ladder.run.stepped_peak_lr needs ladder.run.wsd_s: true (stages)")
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

    def plan(self, params: int, seq_len: int, non_embedding_params: int | None = None) -> RunPlan:
        if self.budget_params == "non_embedding" and non_embedding_params is None:
            raise ValueError("budget_params non_embedding needs the non-embedding parameter count")
        n = non_embedding_params if self.budget_params == "non_embedding" else params
        tokens = int(self.chinchilla_multiple * self.tokens_per_param * n)
        compute = 6.0 * n * tokens
        if self.batch_size_tokens is not None:
            batch = max(self.min_batch_size, round(self.batch_size_tokens / seq_len))
        else:
            ideal = 0.292 * compute**0.3271 / seq_len
            batch = max(self.min_batch_size, 2 ** round(math.log2(max(ideal, 1))))
        step_tokens = batch * seq_len
        steps = max(1, math.ceil(tokens / step_tokens))
        earlier = self.multiples()[:-1]
        named = {round(m * self.tokens_per_param * n / step_tokens): m for m in earlier}
        named = {s: m for s, m in named.items() if 0 < s < steps}
        named[steps] = self.chinchilla_multiple
        checkpoints = sorted(named)
        peak = self.learning_rate if self.learning_rate is not None else 0.3118 * compute**-0.125
        first = checkpoints[0] if self.wsd_s else steps
        return RunPlan(
            params=params,
            budget_params=n,
            tokens=steps * step_tokens,
            batch_size=batch,
            seq_len=seq_len,
            num_train_steps=steps,
            learning_rate=peak * self.lr_multiplier,
            warmup=max(1, round(self.warmup_fraction * first)) if self.warmup_fraction else 0,
            checkpoint_steps=checkpoints,
            cycles=checkpoints if self.wsd_s else None,
            decay_fraction=self.decay_fraction,
            checkpoint_names=[f"{named[s]:g}xC" for s in checkpoints],
            cycle_peaks=(
                [math.sqrt(checkpoints[0] / s) for s in checkpoints]
                if self.stepped_peak_lr
                else None
            ),
        )
