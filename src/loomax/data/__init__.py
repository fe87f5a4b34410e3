"""Data: sources of documents, tokenizers, tokenized windows and batch loaders.

`build_lm_datasets(config.data, seq_len)` gives the tokenizer and the train and
validation windows; `BatchLoader` turns the train windows into batches by step, and
`eval_batches` the validation windows into fixed batches.
"""

from loomax.data.config import DataConfig
from loomax.data.dataset import LmDatasets, build_lm_datasets
from loomax.data.loader import BatchLoader, eval_batches
from loomax.data.sources import SourceConfig
from loomax.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from loomax.data.windows import TokenWindows

__all__ = [
    "BatchLoader",
    "DataConfig",
    "LmDatasets",
    "SourceConfig",
    "TokenWindows",
    "build_lm_datasets",
    "eval_batches",
    "load_tokenizer",
    "train_bpe_tokenizer",
]
