"""Which window order a run uses: the global shuffle over finished caches, or the chunked
order of training while they build (`data.stream_while_building`: true | false | auto).

`auto` is decided from the config and the sizes of the files the train sources list, never
from the state of a cache, so a config always gives the same batches: a run on an empty
cache and its rerun on the finished one read the same order. It streams when the listed
files hold more than `data.stream_auto_mb` of text (a .gz/.zst file counted
`COMPRESSED_FACTOR` times its size), or a source is read as a stream (`records_per_shard`,
a streamed `hf` dataset); it keeps the global shuffle for smaller corpora (the demo's), and
where streaming cannot run (`max_documents`, `trainer.num_train_epochs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from loomax.data.config import DataConfig
from loomax.data.sources import SourceConfig, source_file_sizes

COMPRESSED_FACTOR = 4
"""How many bytes of text a byte of a .gz or .zst file is counted as (JSONL compresses ~4x)."""

MB = 1_000_000


@dataclass(frozen=True)
class OrderChoice:
    """The order a run uses and why (the line it logs at start)."""

    streaming: bool
    """Whether the run trains while the caches build, in the chunked order."""
    reason: str

    def describe(self, chunk_shards: int) -> str:
        if self.streaming:
            order = (
                "training while the token caches build; windows shuffled within chunks of "
                f"{chunk_shards} shards (data.stream_chunk_shards), chunks in shard order"
            )
        else:
            order = "the global shuffle over the finished token caches (built first)"
        return f"data order: {order}, because {self.reason}"


def choose_order(config: DataConfig, *, epochs: bool = False) -> OrderChoice:
    """The order of `config` (`epochs`: the run counts `trainer.num_train_epochs`)."""
    setting = config.stream_while_building
    if setting is not True and setting is not False:
        return _auto(config, epochs)
    said = f"data.stream_while_building is {str(setting).lower()}"
    return OrderChoice(bool(setting), said)


def _auto(config: DataConfig, epochs: bool) -> OrderChoice:
    limited = [i for i, s in enumerate(config.train) if s.max_documents is not None]
    if limited:
        return OrderChoice(
            False, f"data.stream_while_building is auto and data.train[{limited[0]}] sets "
            "max_documents (streaming reads shards whole)",
        )  # fmt: skip
    if epochs:
        return OrderChoice(
            False, "data.stream_while_building is auto and trainer.num_train_epochs needs "
            "an epoch's size before training (streaming knows it only at the end)",
        )  # fmt: skip
    total = 0.0
    for i, source in enumerate(config.train):
        size = text_bytes(source)
        if size is None:
            return OrderChoice(
                True, f"data.stream_while_building is auto and data.train[{i}] is read as a "
                "stream (its size is not listed)",
            )  # fmt: skip
        total += size
    limit = config.stream_auto_mb * MB
    above = total > limit
    return OrderChoice(
        above,
        f"data.stream_while_building is auto and the train sources' files hold ~"
        f"{total / MB:,.1f} MB of text, {'above' if above else 'at most'} "
        f"data.stream_auto_mb={config.stream_auto_mb:g}",
    )


def text_bytes(source: SourceConfig) -> float | None:
    """Estimated bytes of text in a source's listed files (a .gz/.zst file counted
    `COMPRESSED_FACTOR` times its size); None for a source read as a stream
    (`records_per_shard`, a streamed `hf` dataset) or a Hub dataset (no files listed)."""
    if source.hf is not None and source.hf.streaming:
        return None
    files = source_file_sizes(source)
    if files is None:
        return None
    return float(
        sum(
            size * (COMPRESSED_FACTOR if url.endswith((".gz", ".zst")) else 1)
            for url, size in files
        )
    )
