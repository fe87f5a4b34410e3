"""The `data` section of a run config: sources, tokenizer and token cache."""

from dataclasses import dataclass, field

from loomax.data.chat.config import ChatConfig
from loomax.data.embedded import PYTHON_STDLIB
from loomax.data.sources import SourceConfig
from loomax.data.tokenizer import MIN_VOCAB_SIZE


def _default_train_sources() -> list[SourceConfig]:
    """The embedded Python standard library corpus, so a run needs no download."""
    return [SourceConfig(embedded=PYTHON_STDLIB)]


@dataclass(frozen=True)
class WeightStage:
    """Mixture weights from a given step on."""

    start: int = 0
    """First step these weights apply to."""
    weights: list[float] = field(default_factory=list)
    """One weight per `data.train` source, in order."""


@dataclass(frozen=True)
class DataConfig:
    """Where the training and validation documents come from and how they are tokenized."""

    tokenizer: str | None = None
    """Path to a tokenizer.json (or its folder), or a Hugging Face hub id (needs network or the HF cache); null = train a byte-level BPE of `tokenizer_vocab_size` on the train sources into the cache dir."""

    tokenizer_vocab_size: int = 8192
    """Vocabulary size of the BPE trained when `tokenizer` is null (>= 260)."""

    cache_dir: str = "cache"
    """Where the trained tokenizer and the tokenized documents are stored and reused."""

    train: list[SourceConfig] = field(default_factory=_default_train_sources)
    """Sources of the training documents; each is a dataset of its own, mixed by the sources' `weight`."""

    validation: list[SourceConfig] = field(default_factory=list)
    """Sources of the validation documents; empty = hold out `validation_fraction` of the train documents."""

    validation_fraction: float = 0.02
    """Share of train documents held out for validation when `validation` is empty (whole documents; if they fill no window, the last windows of each source)."""

    shuffle: bool = True
    """Shuffle the order of training windows, with a new permutation each epoch."""

    shuffle_seed: int | None = None
    """Seed of the window order and the mixture; null = trainer.seed."""

    weight_schedule: list[WeightStage] = field(default_factory=list)
    """Mixture weights that change at given steps: [{start: 1000, weights: [0.5, 0.5]}]; before the first, the sources' weights."""

    bos: bool = False
    """Prepend the tokenizer's beginning-of-document token to every document (EOS is always appended)."""

    skip_bad_records: bool = False
    """Skip (and count) unreadable records instead of stopping with an error naming file and line."""

    prefetch: int = 4
    """Batches the loader prepares ahead on a background thread; 0 = none."""

    stream_while_building: bool | str = "auto"
    """Start training once the first chunk of each train cache is built, the build going on in the background; windows are then shuffled within chunks of `stream_chunk_shards` shards (the same order whether or not the cache was complete at the start): true | false | auto (true when the train sources' listed files exceed `stream_auto_mb`, from the config and the files' sizes only)."""

    stream_auto_mb: float = 64.0
    """Size above which `stream_while_building: auto` streams: MB of text in the train sources' listed files (a .gz/.zst file counted 4x its size; a `records_per_shard` or streamed `hf` source always above)."""

    stream_chunk_shards: int = 8
    """Shards per chunk of the order `stream_while_building` uses: windows are shuffled within a chunk, chunks come in shard order."""

    format: str = "text"
    """What the sources hold: text (documents, the pretraining objective) | chat (conversations, trained on the turns `chat.loss_on` picks; see docs/post_training.md)."""

    chat: ChatConfig = field(default_factory=ChatConfig)
    """Chat SFT settings (`format: chat`): template, which turns the loss covers, packing."""

    fast_encoder: str = "auto"
    """Cache builds encode with tiktoken where that provably gives the tokenizer's own ids (byte-level BPE, ~4x faster), else with `tokenizers`: auto | off."""

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
        for i, stage in enumerate(self.weight_schedule):
            where = f"data.weight_schedule[{i}]"
            if len(stage.weights) != len(self.train):
                raise ValueError(
                    f"{where}.weights has {len(stage.weights)} entries for {len(self.train)} data.train sources"
                )
            if any(w < 0 for w in stage.weights) or sum(stage.weights) <= 0:
                raise ValueError(
                    f"{where}.weights must be >= 0 with a positive sum, got {stage.weights}"
                )
            if stage.start <= 0 or (i and stage.start <= self.weight_schedule[i - 1].start):
                raise ValueError(f"{where}.start must be > 0 and increasing, got {stage.start}")
        if (
            not isinstance(self.stream_while_building, bool)
            and self.stream_while_building != "auto"
        ):
            raise ValueError(
                "data.stream_while_building must be true, false or auto, "
                f"got {self.stream_while_building!r}"
            )
        if not self.stream_auto_mb >= 0:
            raise ValueError(f"data.stream_auto_mb must be >= 0, got {self.stream_auto_mb}")
        if self.stream_chunk_shards < 1:
            raise ValueError(
                f"data.stream_chunk_shards must be >= 1, got {self.stream_chunk_shards}"
            )
        if self.fast_encoder not in ("auto", "off"):
            raise ValueError(f"data.fast_encoder must be auto or off, got {self.fast_encoder!r}")
        if self.format not in ("text", "chat"):
            raise ValueError(f"data.format must be text or chat, got {self.format!r}")
        if self.format == "chat" and self.tokenizer is None:  # no BPE is trained on turns
            raise ValueError(
                "data.format chat needs data.tokenizer (a tokenizer.json or its folder)"
            )
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch must be >= 0, got {self.prefetch}")
        if self.tokenizer == "":
            raise ValueError("data.tokenizer: give a tokenizer.json path, or null to train one")
