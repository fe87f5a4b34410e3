"""Chat sources (.jsonl or .parquet files of conversations) into packed rows the ``BatchLoader`` reads.

Every conversation is rendered, tokenized and masked on the host (``encode``), then packed
(``packing``): the rows are a pure function of the files, the tokenizer, the template and
the settings, so batch ``k`` is the same in every run and resume (the loader addresses
rows by step, as it does token windows).
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from dataclasses import dataclass, field

import numpy as np

from loomax.config import ConfigError
from loomax.data.chat.encode import check_messages, encode_chat, load_template
from loomax.data.chat.packing import SEGMENTS, TOKENS, WEIGHTS, assign_rows, pack_rows
from loomax.data.config import DataConfig
from loomax.data.sources import SourceConfig, source_paths
from loomax.data.tokenizer import eos_id, load_tokenizer, resolve_tokenizer_path
from loomax.errors import DataSourceError

logger = logging.getLogger(__name__)


class ChatRows:
    """Packed chat rows as the loader's windows: ``get_batch`` gives ``[n, 3, seq_len]``."""

    def __init__(self, rows: np.ndarray, seq_len: int):
        self.rows = rows
        self.seq_len = seq_len
        self.num_tokens = int((rows[:, SEGMENTS] >= 0).sum()) if len(rows) else 0
        """Conversation tokens held (padding not counted)."""
        self.num_trained = int(rows[:, WEIGHTS].sum()) if len(rows) else 0
        """Predictions the loss counts."""

    def __len__(self) -> int:
        return len(self.rows)

    def get_batch(self, indices: np.ndarray) -> np.ndarray:
        return self.rows[np.asarray(indices, dtype=np.int64)]


@dataclass
class ChatDatasets:
    """What ``train_lm`` needs from chat data (the ``LmDatasets`` fields it reads)."""

    tokenizer: object
    tokenizer_path: str
    eos_id: int
    vocab_size: int
    train: list[ChatRows]
    validation: ChatRows
    validation_sets: list[ChatRows] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)
    skipped: list = field(default_factory=list)
    background: None = None

    def close(self) -> None:
        pass

    @property
    def num_train_windows(self) -> int:
        return sum(len(d) for d in self.train)


def _parquet_records(path, key: str):
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    if key not in file.schema_arrow.names:
        raise DataSourceError(f"{path}: no `{key}` column (data.chat.messages_key)")
    row = 0
    for batch in file.iter_batches(columns=[key]):
        for messages in batch.column(0).to_pylist():
            row += 1
            yield f"{path}, row {row}", check_messages(messages, f"{path}, row {row}")


def read_conversations(source: SourceConfig, key: str, where: str):
    """``(place, messages)`` of each record of a source's .jsonl(.gz) or .parquet files, in
    order; a bad record stops with its file and line (row)."""
    if source.hf is not None or source.embedded is not None:
        raise ConfigError(
            f"{where}: data.format chat reads .jsonl and .parquet files (`urls`) only"
        )
    for path in source_paths(source):
        if path.name.endswith(".parquet"):
            yield from _parquet_records(path, key)
            continue
        if not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise ConfigError(f"{where}: {path} is not .jsonl(.gz) or .parquet (data.format chat)")
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                place = f"{path}, line {line_no}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataSourceError(f"{place}: not JSON ({e})") from e
                if not isinstance(record, dict) or key not in record:
                    raise DataSourceError(f"{place}: no `{key}` (data.chat.messages_key)")
                yield place, check_messages(record[key], place)


def held_out(source_index: int, record_index: int, fraction: float) -> bool:
    """Whether a record goes to validation: a hash of its position, below ``fraction``."""
    h = zlib.crc32(f"{source_index}:{record_index}".encode()) / 2**32
    return h < fraction


def build_chat_datasets(config: DataConfig, seq_len: int) -> ChatDatasets:
    """Tokenize, mask and pack every chat source (``data.format: chat``)."""
    if config.tokenizer is None:
        raise ConfigError("data.format chat needs data.tokenizer (a tokenizer.json or its folder)")
    path = resolve_tokenizer_path(config.tokenizer)
    tokenizer = load_tokenizer(path)
    chat = config.chat
    template = load_template(chat.template, tokenizer, path)
    eos = eos_id(tokenizer)

    def encode(source: SourceConfig, where: str, index: int, split: str | None):
        out, dropped = [], 0
        for r, (place, messages) in enumerate(read_conversations(source, chat.messages_key, where)):
            if split is not None and held_out(index, r, config.validation_fraction) != (
                split == "validation"
            ):
                continue
            ids, trained = encode_chat(messages, template, tokenizer, chat.loss_on)
            if len(ids) > seq_len:
                if not chat.drop_overlong:
                    raise DataSourceError(
                        f"{place}: the conversation has {len(ids)} tokens, more than "
                        f"model.seq_len {seq_len}; raise it or set data.chat.drop_overlong"
                    )
                dropped += 1
                continue
            out.append((ids, trained))
        if dropped:
            logger.warning("%s: %d conversation(s) over model.seq_len dropped", where, dropped)
        if not out:
            raise DataSourceError(f"{where}: no conversations ({split or 'all'})")
        rows = assign_rows([len(ids) for ids, _ in out], seq_len, chat.packing)
        return ChatRows(pack_rows(out, rows, seq_len, eos), seq_len)

    own = not config.validation
    train = [
        encode(s, f"data.train[{i}]", i, "train" if own else None)
        for i, s in enumerate(config.train)
    ]
    if own:
        val = [encode(s, f"data.train[{i}]", i, "validation") for i, s in enumerate(config.train)]
    else:
        val = [encode(s, f"data.validation[{i}]", i, None) for i, s in enumerate(config.validation)]
    for i, rows in enumerate(train):
        logger.info(
            "chat data.train[%d]: %d rows of %d, %d tokens, %d trained (template %s, loss on %s)",
            i,
            len(rows),
            seq_len,
            rows.num_tokens,
            rows.num_trained,
            template.name,
            chat.loss_on,
        )
    validation = ChatRows(np.concatenate([v.rows for v in val]), seq_len)
    return ChatDatasets(
        tokenizer, str(path), eos, tokenizer.get_vocab_size(), train, validation, val
    )


__all__ = ["TOKENS", "ChatDatasets", "ChatRows", "build_chat_datasets", "read_conversations"]
