"""``TrainLmConfig``: the whole run YAML of a language-model training job."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import loomax.hooks  # noqa: F401 - registers the hook types `trainer.hooks` may name
from loomax.config import ConfigError
from loomax.data import DataConfig
from loomax.models import Gpt2Config, LmConfig
from loomax.models.attention.sequence_layout import check_split
from loomax.models.moe.expert_parallel import check_expert_split
from loomax.optim import AdamConfig, OptimizerConfig
from loomax.train import TrainerConfig


@dataclass(frozen=True)
class SampleConfig:
    """A text sample printed at the end of training."""

    enabled: bool = True
    """Generate a sample after training."""
    prompt: str = "def "
    """Text the sample starts from."""
    max_new_tokens: int = 64
    """Tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0 = greedy."""


@dataclass(frozen=True)
class TrainLmConfig:
    """A whole training run: data, model, optimizer, trainer (and the closing sample)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Where the text comes from and how it is tokenized."""
    model: LmConfig = field(default_factory=Gpt2Config)
    """The model (`type`: gpt2)."""
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    """The optimizer and its learning-rate schedule (`type`: adam)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, batch, precision, logging and evaluation."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """What to generate once training is done."""

    def __post_init__(self):
        context = self.trainer.mesh.context
        if context > 1:  # the sequence split over trainer.mesh.context: checked before any work
            check_split(self.model.seq_len, context)
            if self.model.attn_pdrop > 0:
                raise ConfigError(
                    "model.attn_pdrop > 0 is not supported with trainer.mesh.context > 1 "
                    f"(got {context}): attention dropout needs the vanilla backend"
                )
            if "linear_attention" in getattr(self.model, "layer_types", ()):
                raise ConfigError(
                    "model.layer_types has linear_attention (Gated DeltaNet) layers: not "
                    f"supported with trainer.mesh.context > 1 (got {context})"
                )
            if getattr(self.model, "sliding_window", None) is not None:
                raise ConfigError(
                    f"model.sliding_window ({self.model.sliding_window}) is not supported with "
                    f"trainer.mesh.context > 1 (got {context}): context-parallel attention is "
                    "full causal"
                )
        self._resolve_document_positions()
        lora = self.model.lora
        if lora is not None:  # adapters alone trained: the rest frozen through trainer.freeze
            added = [p for p in lora.freeze_patterns() if p not in self.trainer.freeze]
            if added:
                trainer = dataclasses.replace(self.trainer, freeze=[*self.trainer.freeze, *added])
                object.__setattr__(self, "trainer", trainer)
        moe = getattr(self.model, "moe", None)
        if moe is not None:  # the experts split over trainer.mesh.expert: checked before any work
            check_expert_split(moe.num_experts, self.trainer.mesh.expert)

    def _resolve_document_positions(self) -> None:
        """``model.document_positions``: null becomes on for chat SFT (a packed conversation
        then computes as it would alone); on needs documents (chat rows or document_mask)."""
        model, chat = self.model, self.data.format == "chat"
        if model.document_positions is None and chat:
            object.__setattr__(self, "model", dataclasses.replace(model, document_positions=True))
        elif model.document_positions and not chat and not model.document_mask:
            raise ConfigError(
                "model.document_positions restarts positions at each packed document: it "
                "needs model.document_mask (or data.format chat)"
            )


def batch_shape(config: TrainLmConfig, rows: int) -> tuple[int, ...]:
    """The shape of a training batch of ``rows`` sequences: ``(rows, seq_len)`` token ids, or
    for chat SFT (``data.format: chat``) ``(rows, 3, seq_len)`` packed rows (tokens, loss
    weights, document ids: ``loomax.data.chat.packing``)."""
    if config.data.format == "chat":
        return (rows, 3, config.model.seq_len)
    return (rows, config.model.seq_len)


def resolve_vocab_size(model_config: LmConfig, tokenizer_vocab: int) -> int:
    """The model's vocabulary size: ``model.vocab_size``, or the tokenizer's when null."""
    if model_config.vocab_size is None:
        return tokenizer_vocab
    if model_config.vocab_size < tokenizer_vocab and model_config.hf_config_json:
        raise ConfigError(
            f"model.vocab_size ({model_config.vocab_size}, the Hugging Face checkpoint's "
            f"vocab_size) is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); train "
            "with the checkpoint's tokenizer (data.tokenizer: its directory)"
        )
    if model_config.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size ({model_config.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}); raise it or set it to null"
        )
    return model_config.vocab_size
