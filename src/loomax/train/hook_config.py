"""``trainer.hooks``: hooks chosen in YAML through a choice registry (``type: divergence``).

Each built-in hook module registers its config with ``@HookConfig.register_subclass(name)``;
a user hook registers the same way, in code imported before the config is parsed.
``build(context)`` turns the config into hooks, given what the run knows
(``HookContext``: the trainer, the model config, the tokenizer, the validation sets...).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import draccus


@dataclass
class HookContext:
    """What a run offers hook configs when it builds them."""

    trainer: Any
    """The ``Trainer`` (run_dir, mesh_jit, shard_batch, config)."""
    model_config: Any = None
    """The ``model`` section (seq_len, flops_per_token)."""
    vocab_size: int | None = None
    """The model's vocabulary size."""
    tokenizer: Any = None
    """The run's HF ``tokenizers.Tokenizer`` (text generation, bits per byte)."""
    validation: dict[str, list[Any]] = field(default_factory=dict)
    """Validation sets by name: lists of this process's rows of each eval batch."""
    loss_fn: Any = None
    """``loss_fn(model, batch, *, key) -> (loss_sum, weight)`` of the run."""
    tokens_per_step: Any = 0
    """Tokens per optimizer step (all processes): an int, or ``tokens(step)`` = tokens trained on in steps 1..step."""
    flops_per_token: float | None = None
    """Training FLOPs per token (forward and backward)."""
    peak_flops: float | None = None
    """Peak FLOP/s of all devices together, if known."""
    config_yaml: str | None = None
    """The whole resolved run config as YAML."""
    primary: bool = True
    """Whether this is process 0 (the one that prints and writes shared files)."""


@dataclass(frozen=True)
class HookConfig(draccus.ChoiceRegistry, abc.ABC):
    """Base of hook configs; ``type`` picks the hook."""

    @abc.abstractmethod
    def build(self, context: HookContext) -> Any:
        """The hook (a ``Hook``, a ``JitHook``) or a list of them."""


def check_positive(config: HookConfig, *names: str) -> None:
    """Raise ``ValueError`` naming ``trainer.hooks[type].field`` if a field is not > 0."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            kind = config.get_choice_name(type(config))
            raise ValueError(f"trainer.hooks ({kind}): {name} must be > 0, got {value}")
