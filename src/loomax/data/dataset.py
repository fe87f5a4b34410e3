"""From a `DataConfig` to tokenized train and validation windows, through the cache."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from loomax.data.cache import file_sha256, fingerprint, load_token_streams, save_token_streams
from loomax.data.config import DataConfig
from loomax.data.sources import SourceConfig, iter_documents, source_fingerprint
from loomax.data.split import SPLIT_SEED, held_out_split
from loomax.data.tokenizer import (
    encode_documents,
    eos_id,
    load_tokenizer,
    resolve_tokenizer_path,
    train_bpe_tokenizer,
)
from loomax.data.windows import TokenWindows, token_stream

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1
"""Bump when the layout or meaning of cached files changes, so old entries are not reused."""

_SPLITS = ("train", "validation")


@dataclass(frozen=True)
class LmDatasets:
    """Everything a language-model run needs from the data: tokenizer and windows."""

    tokenizer: Tokenizer
    """The tokenizer the windows were made with."""

    tokenizer_path: str
    """Its tokenizer.json file (the given one, or the one trained into the cache)."""

    eos_id: int
    """Id of the end-of-document token that follows every document in the streams."""

    vocab_size: int
    """`tokenizer.get_vocab_size()`: every token id is below it."""

    train: TokenWindows
    """Training windows."""

    validation: TokenWindows
    """Validation windows, from documents the training windows do not contain."""


def build_lm_datasets(config: DataConfig, seq_len: int) -> LmDatasets:
    """Trains or loads the tokenizer, tokenizes the documents and cuts them into windows.

    The trained tokenizer (keyed by the train sources and vocabulary size) and the token
    streams (keyed by the sources, the tokenizer file and the split settings) are cached
    under `config.cache_dir`, so a second call with the same config reads them back
    instead of tokenizing again. The streams do not depend on `seq_len`.
    """
    cache_dir = Path(config.cache_dir)
    train_fingerprints = [source_fingerprint(source) for source in config.train]
    train_documents: list[str] | None = None

    if config.tokenizer is None:
        key = fingerprint(
            {"sources": train_fingerprints, "vocab_size": config.tokenizer_vocab_size}
        )
        tokenizer_path = cache_dir / "tokenizers" / f"bpe-{key}" / "tokenizer.json"
        if not tokenizer_path.is_file():
            train_documents = _read_documents(config.train)
            start = time.perf_counter()
            train_bpe_tokenizer(train_documents, config.tokenizer_vocab_size, tokenizer_path)
            logger.info(
                "trained BPE tokenizer in %.1fs: %s", time.perf_counter() - start, tokenizer_path
            )
    else:
        tokenizer_path = resolve_tokenizer_path(config.tokenizer)
    tokenizer = load_tokenizer(tokenizer_path)

    key = fingerprint(
        {
            "format": _CACHE_FORMAT,
            "train": train_fingerprints,
            "validation": [source_fingerprint(source) for source in config.validation],
            "tokenizer_sha256": file_sha256(tokenizer_path),
            "split": None
            if config.validation
            else {"fraction": config.validation_fraction, "seed": SPLIT_SEED},
        }
    )
    entry = cache_dir / "tokens" / key
    streams = load_token_streams(entry, _SPLITS)
    if streams is None:
        if train_documents is None:
            train_documents = _read_documents(config.train)
        start = time.perf_counter()
        streams, metadata = _tokenize_splits(config, tokenizer, train_documents)
        metadata["tokenizer_path"] = str(tokenizer_path)
        save_token_streams(entry, streams, metadata)
        logger.info("tokenized in %.1fs into %s", time.perf_counter() - start, entry)

    train = TokenWindows(streams["train"], seq_len)
    validation = TokenWindows(streams["validation"], seq_len)
    if len(train) == 0:
        raise ValueError(
            f"the training data has {train.num_tokens} tokens, fewer than seq_len={seq_len} "
            "needed for one window; add documents to `data.train` or lower `model.seq_len`"
        )
    if len(validation) == 0:
        more = (
            "add documents to `data.validation`"
            if config.validation
            else "raise `data.validation_fraction` or give `data.validation` sources"
        )
        raise ValueError(
            f"the validation data has {validation.num_tokens} tokens, fewer than "
            f"seq_len={seq_len} needed for one window; {more}"
        )
    return LmDatasets(
        tokenizer=tokenizer,
        tokenizer_path=str(tokenizer_path),
        eos_id=eos_id(tokenizer),
        vocab_size=tokenizer.get_vocab_size(),
        train=train,
        validation=validation,
    )


def _read_documents(sources: list[SourceConfig]) -> list[str]:
    """All documents of `sources`, concatenated in order."""
    return [document for source in sources for document in iter_documents(source)]


def _tokenize_splits(
    config: DataConfig, tokenizer: Tokenizer, train_documents: list[str]
) -> tuple[dict[str, np.ndarray], dict]:
    """The train and validation token streams, and a record of how they were made."""
    encoded = encode_documents(tokenizer, train_documents)
    if config.validation:
        train_docs = encoded
        validation_docs = encode_documents(tokenizer, _read_documents(config.validation))
    else:
        train_indices, validation_indices = held_out_split(len(encoded), config.validation_fraction)
        train_docs = [encoded[i] for i in train_indices]
        validation_docs = [encoded[i] for i in validation_indices]
    streams = {
        "train": token_stream(train_docs),
        "validation": token_stream(validation_docs),
    }
    metadata = {
        "format": _CACHE_FORMAT,
        "documents": {"train": len(train_docs), "validation": len(validation_docs)},
        "tokens": {name: int(stream.size) for name, stream in streams.items()},
    }
    return streams, metadata
