"""Text generation: samples from fixed prompts every N steps, logged as ``samples/<i>``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from loomax.models.generate import sample_tokens
from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


class TextGenHook(Hook):
    """Every ``every`` steps, decodes ``max_new_tokens`` after each prompt with a fixed key.

    ``encode(text) -> ids`` and ``decode(ids) -> text`` come from the tokenizer;
    ``prepare(model)`` casts it for compute. Every process samples (the model may be
    sharded over them); the samples join the step's record.
    """

    def __init__(
        self,
        every: int,
        prompts: list[str],
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        seq_len: int,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int = 0,
        prepare: Callable[[Any], Any] = lambda model: model,
    ):
        if not prompts:
            raise ValueError("text generation needs at least one prompt")
        self.every = every
        self.prompts = list(prompts)
        self.encode, self.decode, self.prepare = encode, decode, prepare
        self.seq_len = seq_len
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.samples: list[tuple[int, list[str]]] = []
        """(step, texts) of the latest generations."""

    def on_step(self, info: StepInfo) -> None:
        model = self.prepare(info.state.model)
        texts = []
        for i, prompt in enumerate(self.prompts):
            ids = sample_tokens(
                model,
                self.encode(prompt) or [0],
                seq_len=self.seq_len,
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                key=jax.random.PRNGKey(self.seed + i),
            )
            texts.append(self.decode(ids))
        self.samples = [*self.samples[-9:], (info.step, texts)]
        info.log({f"samples/{i}": text for i, text in enumerate(texts)})
        for text in texts:
            logger.info("sample at step %d: %r", info.step, text)


@HookConfig.register_subclass("textgen")
@dataclass(frozen=True)
class TextGenConfig(HookConfig):
    """Samples from fixed prompts every N steps, logged as samples/<i>."""

    every: int = 500
    """Generate every this many steps."""
    prompts: list[str] = field(default_factory=lambda: ["def "])
    """The prompts (text)."""
    max_new_tokens: int = 32
    """Tokens generated per prompt."""
    temperature: float = 0.0
    """Softmax temperature; 0 = greedy."""
    seed: int = 0
    """Seed of the sampling keys (prompt i uses seed + i)."""

    def __post_init__(self):
        check_positive(self, "every", "max_new_tokens")
        if not self.prompts:
            raise ValueError("trainer.hooks (textgen): prompts must not be empty")
        if self.temperature < 0:
            raise ValueError(
                f"trainer.hooks (textgen): temperature must be >= 0, got {self.temperature}"
            )

    def build(self, context: HookContext) -> Hook:
        if context.tokenizer is None:
            raise ValueError("trainer.hooks (textgen) needs the run's tokenizer")
        tokenizer, policy = context.tokenizer, context.trainer_config.policy
        return TextGenHook(
            self.every,
            list(self.prompts),
            encode=lambda text: tokenizer.encode(text).ids,
            decode=tokenizer.decode,
            seq_len=context.model_config.seq_len,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            prepare=policy.cast_to_compute,
        )
