"""From a `DataConfig` to a tokenizer and tokenized windows, through the Ray-built token cache.

Every `data.train` source gets a cache of its own (it is one dataset of the mixture);
validation documents come from the `data.validation` sources' caches, or, without
them, from the documents each train cache holds out (`data.validation_fraction`, by a
hash of the shard's position in the source and the document's position in the shard,
not of any path). When the held-out documents make no whole window (a small corpus, a
single file or document), the last windows of each train source's stream are held out
instead. A BPE trained here sees only the documents the train split keeps. Caches live under
`<data.cache_dir>/tokens/` in folders named by a fingerprint of everything their
contents depend on, so a changed source, tokenizer or setting gets a new cache and an
unchanged config reuses the old one (resuming an interrupted build).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from loomax.data.config import DataConfig
from loomax.data.record_shards import RecordShards
from loomax.data.report import (
    SkippedRecords,
    describe_shards,
    skipped_records,
)
from loomax.data.run_tokenizer import HOLDOUT_SEED, holdout_fraction, prepare_tokenizer
from loomax.data.sources import (
    Shard,
    SourceConfig,
    source_shards,
)
from loomax.data.token_cache import (
    TokenCache,
    TokenCacheDamaged,
    TokenCacheInfo,
    cache_fingerprint,
)
from loomax.data.token_cache.reader import TokenSplit
from loomax.data.token_cache.shared import build_shared
from loomax.data.tokenizer import eos_id, load_tokenizer
from loomax.data.windows import SplitWindows, TokenWindows
from loomax.distributed import RayConfig, barrier, coordination_client
from loomax.errors import DataSourceError
from loomax.storage import to_url

if TYPE_CHECKING:
    from loomax.data.background_build import BackgroundBuilds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LmDatasets:
    """Everything a language-model run needs from the data: tokenizer and windows."""

    tokenizer: Tokenizer
    """The tokenizer the windows were made with."""

    tokenizer_path: str
    """Its tokenizer.json file (the given one, or the one trained into the cache)."""

    eos_id: int
    """Id of the end-of-document token that follows every document."""

    vocab_size: int
    """`tokenizer.get_vocab_size()`: every token id is below it."""

    train: list[SplitWindows]
    """Training windows, one dataset per `data.train` source."""

    validation: TokenWindows
    """Validation windows (in memory), from documents the training windows do not contain."""

    caches: list[str]
    """URLs of the token caches used (train sources, then validation sources)."""

    validation_sets: list[TokenWindows] = field(default_factory=list)
    """`validation` per source: each `data.validation` source (or each train source's held-out documents)."""

    skipped: list[SkippedRecords] = field(default_factory=list)
    """Bad records each source's cache skipped (`data.skip_bad_records`), with examples."""

    background: BackgroundBuilds | None = None
    """The train caches' builds still running (`data.stream_while_building`), else None."""

    def close(self) -> None:
        """Stops the builds still running in the background (their finished shards are kept)."""
        if self.background is not None:
            self.background.close()

    @property
    def num_train_windows(self) -> int:
        return sum(len(d) for d in self.train)


@dataclass(frozen=True)
class CachePlan:
    """Where one source's token cache lives and what it is built from."""

    shards: Sequence[Shard]
    """The source's shards: files or dataset pieces, or a `RecordShards` stream."""
    url: str
    key: str
    """The fingerprint of its settings (part of `url`)."""
    settings: dict


def cache_plan(
    config: DataConfig, tokenizer_path: str | Path, kind: str, index: int, source: SourceConfig
) -> CachePlan:
    """The cache of `data.<kind>[index]`: `<cache_dir>/tokens/<kind><index>-<fingerprint>`."""
    shards = RecordShards(source) if source.records_per_shard else source_shards(source)
    settings = {
        "max_documents": source.max_documents,
        "holdout_fraction": holdout_fraction(config) if kind == "train" else 0.0,
        "holdout_seed": HOLDOUT_SEED,
        "bos": config.bos,
    }
    key = cache_fingerprint(shards, str(tokenizer_path), **settings)
    url = f"{config.cache_dir.rstrip('/')}/tokens/{kind}{index}-{key}"
    return CachePlan(shards, url, key, settings)


def build_caches(
    config: DataConfig,
    tokenizer_path: str | Path,
    *,
    ray: RayConfig | None = None,
    overwrite: bool = False,
    progress: bool = True,
    kinds: tuple[str, ...] = ("train", "validation"),
    rebuild: str | None = None,
) -> tuple[list[TokenCacheInfo], list[TokenCacheInfo]]:
    """Build (or reuse, or resume) the token caches of the train and validation sources
    (of `kinds`), each under its lease: a cache another run builds is waited for. The
    cache at URL `rebuild` (found damaged by a read) is deleted and rebuilt under its lease."""

    def build(kind: str, index: int, source: SourceConfig) -> TokenCacheInfo:
        plan = cache_plan(config, tokenizer_path, kind, index, source)
        return build_shared(
            plan.shards,
            str(tokenizer_path),
            plan.url,
            rebuild=to_url(plan.url) == rebuild,
            **plan.settings,
            skip_bad_records=config.skip_bad_records,
            fast_encoder=config.fast_encoder != "off",
            overwrite=overwrite,
            ray_config=ray or RayConfig(),
            progress=progress,
        )

    train = [build("train", i, s) for i, s in enumerate(config.train)] if "train" in kinds else []
    validation = [build("validation", i, s) for i, s in enumerate(config.validation)]
    return train, validation


def build_lm_datasets(
    config: DataConfig, seq_len: int, *, ray: RayConfig | None = None, overwrite: bool = False
) -> LmDatasets:
    """The tokenizer and the train and validation windows of ``config`` for ``seq_len``.

    With several JAX processes only process 0 trains the tokenizer and builds the caches;
    the others wait for it and then open them. Alone, a cache a read here finds damaged is rebuilt.
    """
    primary = coordination_client() is None or _process_index() == 0
    tokenizer_path = prepare_tokenizer(config) if primary else None
    if primary:
        train_infos, validation_infos = build_caches(
            config, tokenizer_path, ray=ray, overwrite=overwrite
        )
    barrier("loomax_data_caches", timeout=24 * 3600)
    if not primary:
        tokenizer_path = prepare_tokenizer(config)
        train_infos, validation_infos = build_caches(
            config, tokenizer_path, ray=ray, progress=False
        )
    known = (config, seq_len, load_tokenizer(tokenizer_path), tokenizer_path)
    try:
        return _lm_datasets(*known, train_infos, validation_infos)
    except TokenCacheDamaged as error:  # a read met damage: rebuild, when alone
        if coordination_client() is not None:
            raise
        logger.warning("%s; rebuilding it", error)
        damaged_root = error.root
    caches = build_caches(config, tokenizer_path, ray=ray, rebuild=damaged_root)
    return _lm_datasets(*known, *caches)


def _lm_datasets(
    config: DataConfig, seq_len: int, tokenizer: Tokenizer, tokenizer_path: str | Path,
    train_infos: list[TokenCacheInfo], validation_infos: list[TokenCacheInfo],
) -> LmDatasets:  # fmt: skip
    """`build_lm_datasets` once the caches are built: their windows, read or opened."""
    splits = [TokenCache.open(info.url)["train"] for info in train_infos]
    if config.validation:
        train = [SplitWindows(split, seq_len) for split in splits]
        pieces = [TokenCache.open(info.url)["train"].as_numpy() for info in validation_infos]
    else:
        train, pieces = _hold_out(config, train_infos, splits, seq_len)
    validation = TokenWindows(
        np.concatenate(pieces) if pieces else np.zeros(0, np.int32),
        seq_len,
    )
    for i, (windows, info) in enumerate(zip(train, train_infos, strict=True)):
        if len(windows) == 0:
            skipped = info.documents_skipped
            noun = "shards" if config.train[i].hf is not None else "files"
            raise DataSourceError(
                f"data.train[{i}] has {windows.num_tokens} tokens, fewer than seq_len={seq_len} "
                "needed for one window"
                + (f" ({skipped:,} bad record(s) skipped)" if skipped else "")
                + f"; {describe_shards(info.shard_documents, noun=noun)}"
                + "; add documents or lower `model.seq_len`"
            )
    if len(validation) == 0:
        more = (
            "; ".join(
                f"data.validation[{i}]: {describe_shards(info.shard_documents)}"
                for i, info in enumerate(validation_infos)
            )
            + "; add documents to `data.validation`"
            if config.validation
            else f"the documents `data.validation_fraction`={config.validation_fraction:g} holds "
            "out make no window, and no data.train source has windows enough to hold one out "
            "and train on another; add documents, lower `model.seq_len` or give "
            "`data.validation` sources"
        )
        raise DataSourceError(
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
        caches=[i.url for i in train_infos + validation_infos],
        validation_sets=[TokenWindows(p, seq_len) for p in pieces],
        skipped=skipped_records("train", train_infos)
        + skipped_records("validation", validation_infos),
    )


def _hold_out(
    config: DataConfig, infos: list[TokenCacheInfo], splits: list[TokenSplit], seq_len: int
) -> tuple[list[SplitWindows], list[np.ndarray]]:
    """The train windows and validation tokens of each train source, without `data.validation`.

    The documents each cache holds out are the validation data when together they make a
    whole window. Otherwise (too few documents: one small file, a single document) each
    source's last `validation_fraction` of windows (at least one, if one is left to train
    on) is held out instead: a pure function of the cache and `seq_len`, so every build
    and every resumed run splits the same way. The log says which was done, and why.
    """
    fraction = config.validation_fraction
    held = [info.splits["validation"] for info in infos]
    if sum(h.tokens for h in held) >= seq_len:
        for i, info in enumerate(infos):
            logger.info(
                "data.train[%d]: %d of %d documents (in %d %s) held out for validation "
                "(data.validation_fraction=%g): %d tokens",
                i,
                held[i].documents,
                sum(s.documents for s in info.splits.values()),
                info.shards_used,
                "shards" if config.train[i].hf is not None else "files",
                fraction,
                held[i].tokens,
            )
        validation = [TokenCache.open(info.url)["validation"].as_numpy() for info in infos]
        return [SplitWindows(split, seq_len) for split in splits], validation
    train, validation, said = [], [], []
    for i, split in enumerate(splits):
        windows = split.num_tokens // seq_len
        held_windows = 0 if windows < 2 else min(max(1, round(fraction * windows)), windows - 1)
        kept = windows - held_windows
        train.append(SplitWindows(split, seq_len, num_windows=kept))
        validation.append(split.read(kept * seq_len, windows * seq_len))
        said.append(f"the last {held_windows} of {windows} windows of data.train[{i}]")
    logger.warning(
        "the %d document(s) held out of data.train for validation (data.validation_fraction=%g "
        "of %d document(s) in %d %s) make %d tokens, fewer than one window of seq_len=%d: "
        "holding out %s for validation instead%s",
        sum(h.documents for h in held),
        fraction,
        sum(s.documents for info in infos for s in info.splits.values()),
        sum(info.shards_used for info in infos),
        "shard(s)" if any(source.hf is not None for source in config.train) else "file(s)",
        sum(h.tokens for h in held),
        seq_len,
        ", ".join(said),
        " (the BPE tokenizer was trained on their text too)" if config.tokenizer is None else "",
    )
    return train, validation


def _process_index() -> int:
    import jax

    return jax.process_index()
