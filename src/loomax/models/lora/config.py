"""``model.lora``: which linear layers get low-rank adapters, and their shape."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from loomax.config import ConfigError

ADAPTER_LEAVES = ("lora_a", "lora_b", "lora_m")
"""The names of an adapter's arrays inside a ``LoraLinear``: A, B and (DoRA) the magnitude."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters W + (alpha / rank) * B A on the linear layers ``targets`` names; the
    rest of the model frozen (no gradient, no optimizer state)."""

    targets: tuple[str, ...] = ("attn", "mlp")
    """Regexes (re.search) on the dotted names of the linear layers that get adapters, e.g. blocks.stacked.attn.q_proj; each must match one."""
    rank: int = 8
    """The adapters' rank r (> 0)."""
    alpha: float = 16.0
    """The adapters' scale numerator: their output is times alpha / rank (as PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout rate on the adapters' input, in training only (the step's key); 0 = off."""
    seed: int = 0
    """Seed of the A matrices' random init (B starts at zero, so the first step's model is the base)."""
    train_base: bool = False
    """Train the base weights too (no freezing); false = adapters alone, as LoRA."""
    extra: tuple[str, ...] = field(default_factory=tuple)
    """Regexes of further parameters trained beside the adapters (e.g. norm scales); none by default."""
    quantize_base: str = "none"
    """QLoRA: the adapted layers' frozen weights stored quantised in blocks, dequantised per matmul: none, int8 or nf4."""
    quantize_block: int = 64
    """Entries per block (one scale each) along a quantised weight's last input axis."""
    dora: bool = False
    """DoRA: a learned magnitude per output unit times the adapted weight's direction (linear layers; not expert weights)."""

    def __post_init__(self):
        for key in ("targets", "extra"):  # a list from YAML: hashable, as the model config is
            object.__setattr__(self, key, tuple(getattr(self, key)))
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"model.lora.rank must be a positive integer, got {self.rank!r}")
        if not self.targets:
            raise ConfigError("model.lora.targets is empty: name the linear layers to adapt")
        if self.alpha == 0:
            raise ConfigError("model.lora.alpha must not be 0 (the adapters would do nothing)")
        if self.quantize_base not in ("none", "int8", "nf4"):
            raise ConfigError(
                f"model.lora.quantize_base must be none, int8 or nf4, got {self.quantize_base!r}"
            )
        if self.quantize_block <= 0:
            raise ConfigError(f"model.lora.quantize_block must be > 0, got {self.quantize_block}")
        if self.quantize_base != "none" and self.train_base:
            raise ConfigError(
                "model.lora.quantize_base stores the base frozen (quantised): it cannot be "
                "trained with model.lora.train_base"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        for key in ("targets", "extra"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ConfigError(f"model.lora.{key}: bad regex {pattern!r} ({e})") from e

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapters' output is multiplied by."""
        return self.alpha / self.rank

    def freeze_patterns(self) -> list[str]:
        """The ``trainer.freeze`` regexes that leave the adapters (and ``extra``) trained."""
        if self.train_base:
            return []
        keep = [r"\.lora_[abm]$", *self.extra]
        return [f"^(?!.*(?:{'|'.join(f'(?:{k})' for k in keep)}))"]
