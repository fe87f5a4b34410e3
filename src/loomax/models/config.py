"""The ``model`` section: a choice registry of language-model configs (``model.type``)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import draccus
import equinox as eqx
import haliax as hax
import jax
from jaxtyping import PRNGKeyArray


@dataclass(frozen=True)
class LmConfig(draccus.ChoiceRegistry, abc.ABC):
    """Base of every language-model config; ``type`` picks the implementation."""

    seq_len: int = 1024
    """Tokens per training sequence (the `position` axis)."""
    vocab_size: int | None = None
    """Vocabulary size; null = take it from the tokenizer."""
    gradient_checkpointing: bool = True
    """Recompute each layer's activations in the backward pass instead of storing them."""
    cross_entropy_block_size: int | None = 4096
    """Tokens per block of the fused LM head + softmax (bounds logits memory); null = plain full logits."""

    def __post_init__(self):
        if self.seq_len <= 1:
            raise ValueError(f"model.seq_len must be > 1, got {self.seq_len}")
        if self.cross_entropy_block_size is not None and self.cross_entropy_block_size <= 0:
            raise ValueError(
                f"model.cross_entropy_block_size must be positive or null, got {self.cross_entropy_block_size}"
            )
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"model.vocab_size must be positive, got {self.vocab_size}")

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "gpt2"

    @abc.abstractmethod
    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> LmModel:
        """A freshly initialised model with a vocabulary of ``vocab_size``."""

    @abc.abstractmethod
    def flops_per_token(self, vocab_size: int) -> float:
        """Forward-pass FLOPs per token (multiply by 3 for a training step)."""

    def param_count(self, vocab_size: int) -> int:
        """Number of parameters, computed without allocating them."""
        shapes = jax.eval_shape(lambda: self.build(vocab_size, key=jax.random.PRNGKey(0)))
        return sum(x.size for x in jax.tree.leaves(shapes) if hasattr(x, "size"))


class LmModel(eqx.Module):
    """What the loss, the trainer and generation need from a language model."""

    @property
    @abc.abstractmethod
    def Vocab(self) -> hax.Axis:
        """The vocabulary axis."""

    @abc.abstractmethod
    def hidden_states(
        self, tokens: hax.NamedArray, *, key: PRNGKeyArray | None = None
    ) -> hax.NamedArray:
        """Final (normed) activations, axes ``(..., position, embed)``."""

    @abc.abstractmethod
    def lm_head_weight(self) -> hax.NamedArray:
        """The output projection, axes ``(vocab, embed)``."""

    def logits(self, tokens: hax.NamedArray, *, key: PRNGKeyArray | None = None) -> hax.NamedArray:
        """Next-token logits, axes ``(..., position, vocab)``."""
        return hax.dot(self.hidden_states(tokens, key=key), self.lm_head_weight(), axis="embed")
