"""Evaluation sets of a run: this process's rows of each validation batch, named per source."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from loomax.config import ConfigError
from loomax.data import LmDatasets, eval_batches
from loomax.data.loader import process_rows
from loomax.lm.config import TrainLmConfig

logger = logging.getLogger(__name__)


def eval_sets(
    config: TrainLmConfig, data: LmDatasets, dp: int, rows: tuple[int, int] = (0, 1)
) -> list[np.ndarray] | dict[str, list[np.ndarray]]:
    """This process's rows of the eval batches (``rows``: row block ``index`` of ``count``,
    ``MeshRuntime.row_block``; default all): one list, or ``{name: batches}`` per
    validation source when there are several."""
    size = config.trainer.eval_batch_size or config.trainer.batch_schedule.sizes[0]
    limit = config.trainer.max_eval_batches_of(size, config.model.seq_len)
    sets: dict[str, list[np.ndarray]] = {}
    if len(data.validation_sets) > 1:
        sources = config.data.validation or config.data.train
        for i, (source, windows) in enumerate(zip(sources, data.validation_sets, strict=True)):
            name = source_name(source, i)
            while name in sets:
                name += "_"
            if len(windows) == 0:
                logger.warning("validation set %s has no whole window: not evaluated", name)
                continue
            sets[name] = eval_batches(windows, size, limit)
    if not sets:
        sets[""] = eval_batches(data.validation, size, limit)
    sizes = sorted({len(b) for batches in sets.values() for b in batches})
    uneven = config.trainer.allow_nondivisible_batch_size  # such batches go whole to each device
    if any(n % dp for n in sizes) and not uneven:
        raise ConfigError(
            f"eval batches of {sizes} sequences do not split over the data-parallel "
            f"size {dp}: set trainer.eval_batch_size to a multiple of {dp} (and give data.validation at least that many windows)"
        )
    micro = config.trainer.eval_microbatch_rows(dp)
    if micro is not None and any(n > micro and (n % micro or n % dp) for n in sizes):
        raise ConfigError(
            f"trainer.per_device_eval_parallelism ({config.trainer.per_device_eval_parallelism}) "
            f"must divide the eval batch per device (eval batches of {sizes} sequences over "
            f"{dp} data-parallel devices)"
        )
    out = {
        name: [b[process_rows(len(b), *rows)] for b in batches] for name, batches in sets.items()
    }
    return out[""] if "" in out else out


def source_name(source, index: int) -> str:
    """A short metric-safe name for a data source: its file stem, dataset id or embedded corpus."""
    if source.urls:
        name = Path(source.urls[0]).name.split(".")[0]
    elif source.hf is not None:
        name = source.hf.id.rsplit("/", 1)[-1]
    elif source.embedded:
        name = source.embedded
    else:
        name = ""
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")
    return name or f"set{index}"
