"""What ``gzip -9`` makes of a run's held-out documents: the bits-per-byte bar a model should beat.

The demo trains on the embedded corpus and holds out ``data.validation_fraction`` of its
files; each held-out file is compressed alone (as ``gzip -9 FILE`` would), and the total
compressed bits over the total raw bytes is set beside the model's ``eval/bpb``.
"""

from __future__ import annotations

import gzip
import itertools

from loomax.data.config import DataConfig
from loomax.data.run_tokenizer import HOLDOUT_SEED, holdout_fraction
from loomax.data.sources import read_shard, source_shards
from loomax.data.token_cache import is_held_out


def held_out_documents(config: DataConfig) -> list[str]:
    """The train sources' documents that the caches hold out for validation (none when
    ``data.validation`` is given), picked exactly as the cache build picks them."""
    fraction = holdout_fraction(config)
    documents = []
    if fraction <= 0:
        return documents
    for source in config.train:
        left = source.max_documents
        for position, shard in enumerate(source_shards(source)):
            texts = itertools.islice(read_shard(shard), left)
            index = -1
            for index, text in enumerate(texts):
                if is_held_out(position, index, fraction, HOLDOUT_SEED):
                    documents.append(text)
            if left is not None:
                left -= index + 1
                if left <= 0:
                    break
    return documents


def gzip_bits_per_byte(documents: list[str], level: int = 9) -> float | None:
    """Bits per UTF-8 byte of ``documents`` each gzip-compressed alone (header and trailer
    included, as in a ``.gz`` file), or None for no bytes."""
    raw = [doc.encode("utf-8") for doc in documents]
    total = sum(len(b) for b in raw)
    if not total:
        return None
    packed = sum(len(gzip.compress(b, compresslevel=level, mtime=0)) for b in raw)
    return 8 * packed / total
