"""``TrainDpoConfig``: the whole run YAML of a DPO job (``loomax dpo``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import loomax.hooks  # noqa: F401 - registers the hook types `trainer.hooks` may name
from loomax.config import ConfigError
from loomax.models import Gpt2Config, LmConfig
from loomax.optim import AdamConfig, OptimizerConfig
from loomax.train import TrainerConfig

LOSSES = ("sigmoid", "ipo", "simpo")
"""The preference losses ``dpo.loss`` may name."""
REFERENCES = ("cached", "adapters_off")
"""Where ``dpo.reference`` takes the reference log-probs from."""


@dataclass(frozen=True)
class DpoConfig:
    """The `dpo` section: preference pairs, their tokenizer and the preference loss."""

    train: str | None = None
    """A jsonl file of preference pairs, one object a line: {prompt, chosen, rejected} (strings)."""
    validation: str | None = None
    """A jsonl file of held-out pairs (same fields), evaluated every `trainer.steps_per_eval`; null = none."""
    tokenizer: str | None = None
    """A tokenizer.json (or its folder; the checkpoint's own for trainer.initialize_from_hf); null = a byte-level BPE trained on the train pairs, kept in the run dir."""
    tokenizer_vocab_size: int = 512
    """Vocabulary size of the BPE trained when `tokenizer` is null (>= 260)."""
    loss: str = "sigmoid"
    """The preference loss: sigmoid (DPO), ipo, or simpo (no reference)."""
    beta: float = 0.1
    """β: the inverse temperature of the implicit reward (sigmoid, simpo) or IPO's regulariser τ."""
    simpo_gamma_beta_ratio: float = 0.5
    """SimPO's target margin γ as a fraction of β (γ = ratio · β)."""
    max_prompt_len: int | None = None
    """Prompt tokens kept (the end of a longer prompt); null = as many as `model.seq_len` leaves after the response."""
    reference_cache: str | None = None
    """Where the reference log-probs are cached (an .npz); null = dpo_reference.npz in the run dir."""
    chat_template: str | None = None
    """The chat template of chat pairs (a prompt of messages): loomax, chatml, a .jinja file or a tokenizer_config.json; null = the tokenizer folder's, else loomax."""
    reference: str = "cached"
    """The reference model: cached (the starting weights' log-probs, one pass before training) or adapters_off (a LoRA run's own base, the adapters off, in each step: no pass, no cache, no second copy)."""

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"dpo.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if self.reference not in REFERENCES:
            raise ValueError(
                f"dpo.reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}"
            )
        if self.tokenizer_vocab_size < 260:
            raise ValueError(
                f"dpo.tokenizer_vocab_size must be >= 260, got {self.tokenizer_vocab_size}"
            )

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with a reference model (SimPO does not)."""
        return self.loss != "simpo"

    @property
    def cached_reference(self) -> bool:
        """Whether the reference log-probs come from the pass before training (and ride in
        the batches as ``ref_chosen``/``ref_rejected``)."""
        return self.uses_reference and self.reference == "cached"


@dataclass(frozen=True)
class TrainDpoConfig:
    """A whole DPO run: preference data and loss, model (the policy), optimizer, trainer."""

    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference pairs, tokenizer, loss and β."""
    model: LmConfig = field(default_factory=Gpt2Config)
    """The policy model (`type`: gpt2); its starting weights: trainer.initialize_from_hf or trainer.initialize_from."""
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    """The optimizer and its learning-rate schedule (`type`: adam)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, batch (pairs per step), precision, logging, evaluation and checkpoints."""

    def __post_init__(self):
        lora = self.model.lora
        if lora is not None:  # adapters alone trained: the rest frozen, as in loomax train
            added = [p for p in lora.freeze_patterns() if p not in self.trainer.freeze]
            if added:
                trainer = dataclasses.replace(self.trainer, freeze=[*self.trainer.freeze, *added])
                object.__setattr__(self, "trainer", trainer)
        if self.dpo.reference == "adapters_off" and (lora is None or lora.train_base):
            raise ConfigError(
                "dpo.reference adapters_off takes the reference from the policy's frozen base: "
                "it needs model.lora (without model.lora.train_base)"
            )
