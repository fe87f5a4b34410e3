"""Text generation: samples from fixed prompts every N steps, logged as ``samples/<i>``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from loomax.models.generate import sample_tokens
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


@hook_type("textgen")
class TextGenHook(Hook):
    """Every ``every`` steps, decodes ``max_new_tokens`` after each prompt with a fixed key.

    ``encode(text) -> ids`` and ``decode(ids) -> text`` come from the tokenizer;
    ``prepare(model)`` casts it for compute. Every process samples (the model may be
    sharded over them); the samples join the step's record.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
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
            self.check_positive("every", "max_new_tokens")
            self.check(bool(self.prompts), "prompts must not be empty")
            self.check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        seq_len: int,
        prepare: Callable[[Any], Any] = lambda model: model,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.encode, self.decode, self.prepare = encode, decode, prepare
        self.seq_len = seq_len
        self.samples: list[tuple[int, list[str]]] = []
        """(step, texts) of the latest generations."""

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        if context.tokenizer is None:
            raise ValueError("trainer.hooks (textgen) needs the run's tokenizer")
        tokenizer = context.tokenizer
        return cls(
            config,
            encode=lambda text: tokenizer.encode(text).ids,
            decode=tokenizer.decode,
            seq_len=context.model_config.seq_len,
            prepare=context.trainer_config.policy.cast_to_compute,
        )

    def on_step(self, info: StepInfo) -> None:
        model = self.prepare(info.state.model)
        c = self.config
        texts = []
        for i, prompt in enumerate(c.prompts):
            ids = sample_tokens(
                model,
                self.encode(prompt) or [0],
                seq_len=self.seq_len,
                max_new_tokens=c.max_new_tokens,
                temperature=c.temperature,
                key=jax.random.PRNGKey(c.seed + i),
            )
            texts.append(self.decode(ids))
        self.samples = [*self.samples[-9:], (info.step, texts)]
        info.log({f"samples/{i}": text for i, text in enumerate(texts)})
        for text in texts:
            logger.info("sample at step %d: %r", info.step, text)
