"""Data: sources of documents, tokenizers, the Ray-built token cache, windows and loaders.

`build_lm_datasets(config.data, seq_len)` gives the tokenizer and the train (one
dataset per source) and validation windows; `BatchLoader` turns the train windows into
batches by step (a weighted mixture, shuffled by a Feistel permutation), and
`eval_batches` the validation windows into fixed batches.

The names below are imported on first use, so a process that needs one module (a Ray
worker tokenizing a shard imports `loomax.data.token_cache.tasks`) does not import them
all (JAX among them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomax.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from loomax.data.config import DataConfig, WeightStage
    from loomax.data.dataset import LmDatasets, build_lm_datasets
    from loomax.data.loader import BatchLoader, eval_batches
    from loomax.data.report import SkippedRecords, report_skipped
    from loomax.data.sources import HfSourceConfig, SourceConfig
    from loomax.data.token_cache import TokenCache, build_token_cache
    from loomax.data.tokenizer import load_tokenizer, train_bpe_tokenizer
    from loomax.data.windows import SplitWindows, TokenWindows

_EXPORTS = {
    "BatchLoader": "loomax.data.loader",
    "DataConfig": "loomax.data.config",
    "HfSourceConfig": "loomax.data.sources",
    "LmDatasets": "loomax.data.dataset",
    "SkippedRecords": "loomax.data.report",
    "SourceConfig": "loomax.data.sources",
    "SplitWindows": "loomax.data.windows",
    "TokenCache": "loomax.data.token_cache",
    "TokenWindows": "loomax.data.windows",
    "WeightStage": "loomax.data.config",
    "build_lm_datasets": "loomax.data.dataset",
    "build_token_cache": "loomax.data.token_cache",
    "eval_batches": "loomax.data.loader",
    "load_tokenizer": "loomax.data.tokenizer",
    "report_skipped": "loomax.data.report",
    "train_bpe_tokenizer": "loomax.data.tokenizer",
}

__all__ = [
    "BatchLoader",
    "DataConfig",
    "HfSourceConfig",
    "LmDatasets",
    "SkippedRecords",
    "SourceConfig",
    "SplitWindows",
    "TokenCache",
    "TokenWindows",
    "WeightStage",
    "build_lm_datasets",
    "build_token_cache",
    "eval_batches",
    "load_tokenizer",
    "report_skipped",
    "train_bpe_tokenizer",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
