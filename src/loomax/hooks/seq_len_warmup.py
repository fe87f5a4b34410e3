"""Sequence-length warm-up: train on shorter sequences first, with the same tokens per batch.

A batch of ``[rows, seq_len]`` tokens is reshaped to ``[rows * seq_len / n, n]``: each
sequence is cut into pieces of ``n`` tokens. ``n`` grows linearly from ``min_seq_len``
to ``seq_len`` over ``warmup_steps``, rounded down to a length that divides ``seq_len``
and is a multiple of ``min_seq_len``, so there are few distinct shapes (one compile each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loomax.config import ConfigError
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("seq_len_warmup")
class SeqLenWarmupHook(Hook):
    """Reshapes each batch to the warm-up's sequence length; logs ``train/seq_len``.

    ``seq_len`` is the model's (the length reached at the end of the warm-up).
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Linear warm-up of the sequence length from min_seq_len, keeping tokens per batch."""

        min_seq_len: int = 64
        """Starting sequence length; must divide model.seq_len."""
        warmup_steps: int = 1000
        """Steps over which the length grows to model.seq_len."""

        def __post_init__(self):
            self.check_positive("min_seq_len", "warmup_steps")

    config: Config

    def __init__(self, config: Config | None = None, /, *, seq_len: int, **settings: Any):
        super().__init__(config, **settings)
        min_seq_len = self.config.min_seq_len
        if not 0 < min_seq_len <= seq_len or seq_len % min_seq_len:
            raise ConfigError(
                f"seq_len warm-up: min_seq_len ({min_seq_len}) must divide the model's seq_len ({seq_len})"
            )
        self.seq_len = seq_len
        self.lengths = [n for n in range(min_seq_len, seq_len + 1, min_seq_len) if seq_len % n == 0]

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, seq_len=context.model_config.seq_len)

    def length_at(self, step: int) -> int:
        """Sequence length of step ``step`` (counted from 1)."""
        c = self.config
        fraction = min((step - 1) / max(c.warmup_steps, 1), 1.0)
        target = c.min_seq_len + fraction * (self.seq_len - c.min_seq_len)
        return max(n for n in self.lengths if n <= target + 1e-9)

    def transform_batch(self, step: int, batch: Any) -> Any:
        n = self.length_at(step)
        if n == self.seq_len:
            return batch
        tokens = np.asarray(batch)
        if tokens.shape[-1] != self.seq_len:
            raise ValueError(
                f"seq_len warm-up expects batches of {self.seq_len} tokens per row, got {tokens.shape}"
            )
        return tokens.reshape(-1, n)

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        if info.step >= 1:
            record["train/seq_len"] = self.length_at(info.step)
