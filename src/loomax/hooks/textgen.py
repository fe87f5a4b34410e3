"""Text generation: samples from fixed prompts every N steps, logged as ``samples/<i>``.

The prompts are ``prompts``, or those of ``prompts_file`` (a JSON list of strings, or one
prompt per line); sampling takes a temperature, ``top_k``, ``top_p`` and a repetition
penalty.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from loomax.errors import BadFileError, MissingFileError
from loomax.models.decoding.generate import sample_tokens
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
        prompts_file: str | None = None
        """A file of prompts used instead: a JSON list of strings (.json), else one per line."""
        max_new_tokens: int = 32
        """Tokens generated per prompt."""
        temperature: float = 0.0
        """Softmax temperature; 0 = greedy."""
        top_k: int | None = None
        """Sample among the k most likely tokens only; null = all."""
        top_p: float | None = None
        """Sample among the most likely tokens whose probability reaches p (nucleus); null = all."""
        repetition_penalty: float | None = None
        """Divide (multiply, if negative) the logits of tokens already in the text by this (CTRL); null = off."""
        seed: int = 0
        """Seed of the sampling keys (prompt i uses seed + i)."""

        def __post_init__(self):
            self.check_positive("every", "max_new_tokens")
            self.check(bool(self.prompts), "prompts must not be empty")
            self.check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
            self.check_positive("top_k", "repetition_penalty")
            self.check(
                self.top_p is None or 0 < self.top_p <= 1,
                f"top_p must be in (0, 1], got {self.top_p}",
            )

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
        path = self.config.prompts_file
        self.prompts = read_prompts(Path(path)) if path else list(self.config.prompts)
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
        for i, prompt in enumerate(self.prompts):
            ids = sample_tokens(
                model,
                self.encode(prompt) or [0],
                seq_len=self.seq_len,
                max_new_tokens=c.max_new_tokens,
                temperature=c.temperature,
                top_k=c.top_k,
                top_p=c.top_p,
                repetition_penalty=c.repetition_penalty,
                key=jax.random.PRNGKey(c.seed + i),
            )
            texts.append(self.decode(ids))
        self.samples = [*self.samples[-9:], (info.step, texts)]
        info.log({f"samples/{i}": text for i, text in enumerate(texts)})
        for text in texts:
            logger.info("sample at step %d: %r", info.step, text)


def read_prompts(path: Path) -> list[str]:
    """The prompts of ``path``: a JSON list of strings (``.json``), else its non-empty lines."""
    where = f"trainer.hooks (textgen): prompts_file {path}"
    if not path.is_file():
        raise MissingFileError(f"{where} not found")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except ValueError as e:
            raise BadFileError(f"{where}: not JSON ({e})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise BadFileError(f"{where}: expected a JSON list of strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise BadFileError(f"{where} holds no prompt")
    return prompts
