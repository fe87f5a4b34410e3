"""Model configurators: a ladder size -> model config, micro-batch size and minimal mesh."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import draccus

from loomax.ladder.sizes import Shape, parse_size, shape_for
from loomax.models import LmConfig


@dataclass(frozen=True)
class ModelConfigurator(draccus.ChoiceRegistry, abc.ABC):
    """Turns a size (non-embedding parameters) into a model; ``type`` picks the architecture."""

    seq_len: int = 1024
    """Tokens per sequence of every size."""
    vocab_size: int | None = None
    """Vocabulary size; null = the tokenizer's."""
    aspect_ratio: float = 64.0
    """Target width / depth."""
    head_dim: int = 64
    """Width of one attention head (the width is a multiple of it)."""
    max_tokens_per_device: int = 16384
    """Tokens per device per forward/backward; larger batches accumulate gradients (micro-batches)."""
    device_memory_gb: float = 80.0
    """Memory of one device, for the minimal mesh (f32 params, grads and Adam state: 16 bytes/param, at most half the memory)."""

    def __post_init__(self):
        for name in (
            "seq_len",
            "aspect_ratio",
            "head_dim",
            "max_tokens_per_device",
            "device_memory_gb",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ladder.model.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "gpt2"

    def shape(self, size: str | int) -> Shape:
        return shape_for(parse_size(size), aspect_ratio=self.aspect_ratio, head_dim=self.head_dim)

    @abc.abstractmethod
    def model_config(self, size: str | int) -> LmConfig:
        """The model config of ``size``."""

    def micro_batch(self, batch_size: int, devices: int) -> int:
        """``trainer.per_device_parallelism``: sequences per device per forward/backward (-1 = all)."""
        per_device = max(1, batch_size // devices)
        fit = max(1, self.max_tokens_per_device // self.seq_len)
        if fit >= per_device:
            return -1
        while per_device % fit:
            fit -= 1
        return fit

    def min_devices(self, params: int) -> int:
        """The fewest devices (a power of two) whose memory holds params, grads and Adam state."""
        need = 16 * params / (0.5 * self.device_memory_gb * 1e9)
        return 2 ** max(0, math.ceil(math.log2(max(need, 1))))


@ModelConfigurator.register_subclass("gpt2")
@dataclass(frozen=True)
class Gpt2Configurator(ModelConfigurator):
    """GPT-2 models (learned positions, LayerNorm, GELU MLP)."""

    def model_config(self, size: str | int) -> LmConfig:
        from loomax.models import Gpt2Config

        s = self.shape(size)
        return Gpt2Config(
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            hidden_dim=s.hidden_dim,
            num_layers=s.num_layers,
            num_heads=s.num_heads,
        )


@ModelConfigurator.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfigurator(ModelConfigurator):
    """Llama models (RoPE, RMSNorm, SwiGLU MLP of ~8/3 the width)."""

    def model_config(self, size: str | int) -> LmConfig:
        from loomax.models.families.llama import LlamaConfig

        s = self.shape(size)
        intermediate = max(
            self.head_dim, round(s.hidden_dim * 8 / 3 / self.head_dim) * self.head_dim
        )
        return LlamaConfig(
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            hidden_dim=s.hidden_dim,
            intermediate_dim=intermediate,
            num_layers=s.num_layers,
            num_heads=s.num_heads,
            num_kv_heads=s.num_heads,
        )
