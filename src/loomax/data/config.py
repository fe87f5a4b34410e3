"""The `data` section of a run config: sources, tokenizer and token cache."""

from dataclasses import dataclass, field

from loomax.data.embedded import PYTHON_STDLIB
from loomax.data.sources import SourceConfig
from loomax.data.tokenizer import MIN_VOCAB_SIZE


def _default_train_sources() -> list[SourceConfig]:
    """The embedded Python standard library corpus, so a run needs no download."""
    return [SourceConfig(embedded=PYTHON_STDLIB)]


@dataclass(frozen=True)
class DataConfig:
    """Where the training and validation documents come from and how they are tokenized."""

    tokenizer: str | None = None
    """Path to a tokenizer.json; null = train a byte-level BPE of `tokenizer_vocab_size` on the train sources and store it in the cache dir."""

    tokenizer_vocab_size: int = 8192
    """Vocabulary size of the BPE trained when `tokenizer` is null (>= 260)."""

    cache_dir: str = "cache"
    """Where the trained tokenizer and the tokenized documents are stored and reused."""

    train: list[SourceConfig] = field(default_factory=_default_train_sources)
    """Sources of the training documents, concatenated in order (weights are not used yet)."""

    validation: list[SourceConfig] = field(default_factory=list)
    """Sources of the validation documents; empty = hold out `validation_fraction` of the train documents."""

    validation_fraction: float = 0.02
    """Share of train documents held out for validation when `validation` is empty; whole documents, so no overlap."""

    shuffle: bool = True
    """Shuffle the order of training windows, with a new permutation each epoch."""

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("data.train: give at least one training source")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"data.validation_fraction must be in (0, 1), got {self.validation_fraction}"
            )
        if self.tokenizer_vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"data.tokenizer_vocab_size must be >= {MIN_VOCAB_SIZE}, "
                f"got {self.tokenizer_vocab_size}"
            )
        if not self.cache_dir:
            raise ValueError("data.cache_dir must not be empty")
        if self.tokenizer == "":
            raise ValueError("data.tokenizer: give a tokenizer.json path, or null to train one")
