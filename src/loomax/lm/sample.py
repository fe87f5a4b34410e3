"""The text sample a run prints when it ends."""

from __future__ import annotations

from typing import Any

import jax
from tokenizers import Tokenizer

from loomax.lm.config import TrainLmConfig
from loomax.models.decoding.generate import sample_tokens


def sample_text(model: Any, tokenizer: Tokenizer, eos_id: int, config: TrainLmConfig) -> str:
    """``config.sample``'s continuation of its prompt by ``model`` (cast to the compute dtype)."""
    prompt = tokenizer.encode(config.sample.prompt).ids or [eos_id]
    tokens = sample_tokens(
        config.trainer.policy.cast_to_compute(model),
        prompt,
        seq_len=config.model.seq_len,
        max_new_tokens=config.sample.max_new_tokens,
        temperature=config.sample.temperature,
        key=jax.random.PRNGKey(config.trainer.seed + 1),
    )
    return tokenizer.decode(tokens)
