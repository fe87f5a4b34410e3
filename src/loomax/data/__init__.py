"""Data: sources of documents, tokenizers, the Ray-built token cache, windows and loaders.

`build_lm_datasets(config.data, seq_len)` gives the tokenizer and the train (one
dataset per source) and validation windows; `BatchLoader` turns the train windows into
batches by step (a weighted mixture, shuffled by a Feistel permutation), and
`eval_batches` the validation windows into fixed batches.
"""

from loomax.data.config import DataConfig, WeightStage
from loomax.data.dataset import LmDatasets, build_lm_datasets
from loomax.data.loader import BatchLoader, eval_batches
from loomax.data.report import SkippedRecords, report_skipped
from loomax.data.sources import HfSourceConfig, SourceConfig
from loomax.data.token_cache import TokenCache, build_token_cache
from loomax.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from loomax.data.windows import SplitWindows, TokenWindows

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
