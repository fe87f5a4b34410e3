"""A DPO run's data: its tokenizer, its tokenised pairs, and the training batch stream."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loomax.batch_schedule import BatchSchedule
from loomax.data.tokenizer import eos_id, load_tokenizer, train_bpe_tokenizer
from loomax.dpo.config import DpoConfig
from loomax.dpo.pairs import Pair, PairArrays, pair_fields

logger = logging.getLogger(__name__)


def run_tokenizer(config: DpoConfig, train: list[Pair], run_dir: Path):
    """``dpo.tokenizer``, or a byte-level BPE trained on the train pairs and kept in
    ``<run_dir>/tokenizer.json`` (read back when it is there: a resumed run)."""
    if config.tokenizer is not None:
        return load_tokenizer(config.tokenizer)
    path = run_dir / "tokenizer.json"
    if path.is_file():
        return load_tokenizer(path)
    texts = (text for p in train for text in p.texts())
    logger.info("dpo: training a %d-token BPE on the train pairs", config.tokenizer_vocab_size)
    return train_bpe_tokenizer(texts, config.tokenizer_vocab_size, path)


def chat_template(config: DpoConfig, pairs: dict[str, list[Pair]], tokenizer, run_dir: Path):
    """The chat template of the run's chat pairs (``dpo.chat_template``: loaded as ``loomax
    train`` loads ``data.chat.template``); None when no pair is a chat pair."""
    if not any(p.is_chat for side in pairs.values() for p in side):
        return None
    from loomax.data.chat.encode import load_template
    from loomax.data.tokenizer import resolve_tokenizer_path

    path = (
        resolve_tokenizer_path(config.tokenizer) if config.tokenizer else run_dir / "tokenizer.json"
    )
    return load_template(config.chat_template, tokenizer, path)


def tokenizer_eos(tokenizer) -> int:
    """The tokenizer's end-of-document id (starts and ends every pair's rows)."""
    return eos_id(tokenizer)


def train_batches(
    arrays: PairArrays,
    reference: dict[str, np.ndarray] | None,
    schedule: BatchSchedule,
    *,
    seed: int,
    start_step: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of pairs from step ``start_step`` on: pair ``i`` of the stream is pair
    ``perm_e[i mod n]`` of epoch ``e = i div n`` (a fresh permutation per epoch, from
    ``seed``), so a resumed run reads the batches the first run would have."""
    n = len(arrays)
    fields = pair_fields(arrays)
    if reference is not None:
        fields["ref_chosen"] = reference["train/chosen"]
        fields["ref_rejected"] = reference["train/rejected"]
    perms: dict[int, np.ndarray] = {}

    def order(epoch: int) -> np.ndarray:
        if epoch not in perms:
            perms.clear()  # only the current epoch (and the next) are ever asked for
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        return perms[epoch]

    step = start_step
    while True:
        offset, rows = schedule.offset(step), schedule.size_at(step)
        stream = np.arange(offset, offset + rows)
        index = np.array([order(int(i // n))[i % n] for i in stream])
        yield {k: v[index] for k, v in fields.items()}
        step += 1
