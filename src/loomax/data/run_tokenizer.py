"""The tokenizer a run uses: `data.tokenizer` as given, or a BPE trained here on the documents
the train split keeps (those held out for validation never reach it), cached under
`<data.cache_dir>/tokenizers` by a key of the sources, the vocabulary size and the hold-out."""

from __future__ import annotations

import itertools
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loomax.data.cache import fingerprint
from loomax.data.config import DataConfig
from loomax.data.report import SHOWN_EXAMPLES, describe_shards
from loomax.data.sources import ReadStats, Shard, read_shard, source_fingerprint, source_shards
from loomax.data.token_cache import is_held_out
from loomax.data.tokenizer import load_tokenizer, resolve_tokenizer_path, train_bpe_tokenizer
from loomax.errors import BadFileError, DataSourceError
from loomax.storage import local_path, to_url

logger = logging.getLogger(__name__)

HOLDOUT_SEED = 0
"""Seed of the held-out validation documents (part of the cache fingerprint)."""


def tokenizer_cache_dir(cache_dir: str) -> Path:
    """The local folder where BPE tokenizers trained for ``data.cache_dir`` are kept.

    ``<cache_dir>/tokenizers`` for a local cache; for a URL (``memory://``, ``gs://``...),
    which the tokenizers library cannot open, a folder of this machine's temp directory
    named after the URL (each host trains its own, from the same documents).
    """
    url = to_url(cache_dir)
    local = local_path(url)
    if local is not None:
        return Path(local) / "tokenizers"
    return Path(tempfile.gettempdir()) / "loomax-tokenizers" / fingerprint({"cache_dir": url})


def holdout_fraction(config: DataConfig) -> float:
    """Share of the train documents held out for validation: 0 when `data.validation` is given."""
    return 0.0 if config.validation else config.validation_fraction


def prepare_tokenizer(config: DataConfig) -> Path:
    """The tokenizer.json to use: the configured one, or a BPE trained on the documents the
    train split keeps (those held out for validation are not read into it), cached by a
    key of the sources, the vocabulary size and the hold-out."""
    if config.tokenizer is not None:
        return resolve_tokenizer_path(config.tokenizer)
    record: dict = {
        "sources": [source_fingerprint(s) for s in config.train],
        "vocab_size": config.tokenizer_vocab_size,
    }
    if holdout_fraction(config) > 0:  # trained without the held-out documents
        record["holdout"] = {"fraction": holdout_fraction(config), "seed": HOLDOUT_SEED}
    path = tokenizer_cache_dir(config.cache_dir) / f"bpe-{fingerprint(record)}" / "tokenizer.json"
    if path.is_file() and not _loads(path):  # damaged; trained here, so train it again
        logger.warning("the BPE tokenizer %s is damaged: training it again", path)
        path.unlink()
    if not path.is_file():
        start = time.perf_counter()
        shards = [source_shards(source) for source in config.train]
        stats = {shard.name: ReadStats() for group in shards for shard in group}
        held_out = [0]
        documents = _training_documents(config, shards, stats, held_out)
        first = next(documents, None)
        skipped = sum(s.skipped for s in stats.values())
        if first is None:  # every shard was read to its end and held nothing to train on
            raise DataSourceError(
                "data.train holds no documents to train the tokenizer on"
                + (f" ({skipped:,} bad record(s) skipped)" if skipped else "")
                + (f" ({held_out[0]:,} held out for validation)" if held_out[0] else "")
                + f"; {describe_shards({n: s.documents for n, s in stats.items()})}"
                + "; add documents or give `data.tokenizer`"
            )
        train_bpe_tokenizer(itertools.chain([first], documents), config.tokenizer_vocab_size, path)
        logger.info(
            "trained BPE tokenizer in %.1fs on data.train without its %d document(s) held out "
            "for validation: %s",
            time.perf_counter() - start,
            held_out[0],
            path,
        )
        skipped = sum(s.skipped for s in stats.values())  # now that all were read
        if skipped:
            examples = [e for s in stats.values() for e in s.examples][:SHOWN_EXAMPLES]
            logger.warning(
                "tokenizer training skipped %d bad record(s) of data.train, first: %s",
                skipped,
                "; ".join(examples),
            )
    return path


def _loads(path: Path) -> bool:
    """Whether `path` loads as a tokenizer."""
    try:
        return load_tokenizer(path) is not None
    except BadFileError:
        return False


def tokenizer_documents(config: DataConfig) -> Iterator[str]:
    """The documents a BPE for `config` is trained on: those the train split keeps."""
    shards = [source_shards(source) for source in config.train]
    stats = {shard.name: ReadStats() for group in shards for shard in group}
    return _training_documents(config, shards, stats, [0])


def _training_documents(
    config: DataConfig, shards: list[list[Shard]], stats: dict[str, ReadStats], held_out: list[int]
) -> Iterator[str]:
    """The documents of the train sources that their caches' train splits keep, for the
    tokenizer: the first `max_documents` of each source, less those `is_held_out` picks
    exactly as the cache build does. Read documents are counted per shard in `stats`,
    held-out ones in `held_out[0]`."""
    fraction = holdout_fraction(config)
    for source, group in zip(config.train, shards, strict=True):
        left = source.max_documents
        for position, shard in enumerate(group):
            if left == 0:
                break
            documents = read_shard(
                shard, skip_bad_records=config.skip_bad_records, stats=stats[shard.name]
            )
            index = -1
            for index, text in enumerate(itertools.islice(documents, left)):
                if is_held_out(position, index, fraction, HOLDOUT_SEED):
                    held_out[0] += 1
                else:
                    yield text
            if left is not None:
                left -= index + 1
