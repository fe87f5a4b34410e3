"""Batches of windows: a deterministic, resumable training stream and fixed eval batches."""

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from loomax.batch_schedule import BatchSchedule
from loomax.data.mixture import Mixture
from loomax.data.permutation import FeistelPermutation
from loomax.data.windows import TokenWindows
from loomax.errors import DataSourceError


def process_rows(num_rows: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of a global batch in row block `process_index` of `process_count`
    equal blocks (a process's block: ``MeshRuntime.row_block``; the processes of a context
    group spanning hosts load the same block)."""
    share, rem = divmod(num_rows, process_count)
    if rem:
        raise ValueError(
            f"a batch of {num_rows} rows does not split over {process_count} processes"
        )
    return slice(process_index * share, (process_index + 1) * share)


class Windows(Protocol):
    """What the loader reads: fixed-length windows by index (``TokenWindows``, a cache split)."""

    seq_len: int

    def __len__(self) -> int: ...

    def get_batch(self, indices: np.ndarray) -> np.ndarray: ...


class BatchLoader:
    """Training batches addressed by step: batch ``k`` is computed directly, with no replay.

    Stream position ``p = offset(step) + row`` is one sample, where ``offset(step)`` is
    the sum of the batch sizes of the steps before (``step * batch_size`` for a constant
    size; ``batch_size`` may be a ``BatchSchedule``). With several datasets
    a ``Mixture`` decides, per position, which dataset gives it and which of that
    dataset's samples it is (weights may change at given steps). A dataset's ``j``-th
    sample is window ``perm_e(j mod n)`` in epoch ``e = j // n``, where ``perm_e`` is a
    Feistel permutation keyed by ``(seed, dataset, e)`` (the identity without
    ``shuffle``): nothing of size ``n`` is materialised. Each process computes and reads
    only its own rows; ``iter_from`` prefetches batches on a background thread.
    """

    def __init__(
        self,
        windows: Windows | Sequence[Windows],
        batch_size: int | BatchSchedule,
        seed: int,
        shuffle: bool = True,
        *,
        weights: Sequence[float] | None = None,
        weight_schedule: Sequence[tuple[int, Sequence[float]]] = (),
        prefetch: int = 2,
    ) -> None:
        datasets = list(windows) if isinstance(windows, list | tuple) else [windows]
        for i, dataset in enumerate(datasets):
            if len(dataset) == 0:
                raise DataSourceError(f"cannot load batches from dataset {i}: it has zero windows")
        if isinstance(batch_size, int) and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        schedule = (
            batch_size if isinstance(batch_size, BatchSchedule) else BatchSchedule(batch_size)
        )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.datasets = datasets
        self.windows = datasets[0]
        self.schedule = schedule
        self.batch_size = schedule.sizes[0]
        """The batch size of step 0 (the only one without a schedule)."""
        self.seed = seed
        self.shuffle = shuffle
        self.prefetch = prefetch
        self.mixture: Mixture | None = None
        if len(datasets) > 1 or weight_schedule:
            stages = [(0, list(weights) if weights is not None else [1.0] * len(datasets))]
            stages += [
                (schedule.offset(start), list(w)) for start, w in weight_schedule if start > 0
            ]
            self.mixture = Mixture(stages, seed)
        self._perms: dict[tuple[int, int], FeistelPermutation] = {}

    def _permutation(self, dataset: int, epoch: int) -> FeistelPermutation:
        key = (dataset, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = FeistelPermutation(
                len(self.datasets[dataset]), [self.seed, "epoch", dataset, epoch]
            )
            self._perms[key] = perm
        return perm

    def sample_windows(self, dataset: int, samples: np.ndarray) -> np.ndarray:
        """Window indices of ``dataset``'s samples number ``samples`` (epochs wrap around).

        A dataset with an order of its own (``GrowingWindows``: a cache still building,
        shuffled chunk by chunk) is asked for it."""
        own_order = getattr(self.datasets[dataset], "sample_windows", None)
        if own_order is not None:
            return own_order(dataset, samples, self.seed, self.shuffle)
        epochs, offsets = np.divmod(
            np.asarray(samples, dtype=np.int64), len(self.datasets[dataset])
        )
        if not self.shuffle:
            return offsets
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            out[in_epoch] = self._permutation(dataset, int(epoch))(offsets[in_epoch])
        return out

    def epoch_order(self, epoch: int, dataset: int = 0) -> np.ndarray:
        """All window indices of ``dataset``'s epoch ``epoch`` in reading order (materialised: for inspection)."""
        n = len(self.datasets[dataset])
        return self.sample_windows(dataset, np.arange(epoch * n, (epoch + 1) * n))

    def locate(self, step: int, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, window index)`` of each row of batch ``step`` (all rows, or ``rows``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = self.schedule.offset(step)
        positions = np.arange(start, start + self.schedule.size_at(step))[rows or slice(None)]
        if self.mixture is None:
            datasets, samples = np.zeros_like(positions), positions
        else:
            datasets, samples = self.mixture(positions)
        indices = np.empty_like(samples)
        for d in np.unique(datasets):
            mask = datasets == d
            indices[mask] = self.sample_windows(int(d), samples[mask])
        return datasets, indices

    def batch_indices(self, step: int) -> np.ndarray:
        """The window indices of batch ``step`` (of whichever dataset each row comes from)."""
        return self.locate(step)[1]

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Batch ``step`` as an int32 array of shape ``(batch size of step, seq_len)``.

        With ``process_count > 1``, only the rows of block ``process_index`` of
        ``process_count`` (``MeshRuntime.row_block``: a process's block, not always its
        index), ``(batch size / process_count, seq_len)``: the other rows are never read.
        """
        rows = process_rows(self.schedule.size_at(step), process_index, process_count)
        datasets, indices = self.locate(step, rows)
        if len(self.datasets) == 1:
            return np.asarray(self.windows.get_batch(indices), dtype=np.int32)
        out = None  # [rows, seq_len], or [rows, 3, seq_len] for packed chat rows
        for d in np.unique(datasets):
            mask = datasets == d
            part = np.asarray(self.datasets[int(d)].get_batch(indices[mask]))
            if out is None:
                out = np.empty((len(indices), *part.shape[1:]), dtype=np.int32)
            out[mask] = part
        return out

    def iter_from(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[np.ndarray]:
        """Yields batch ``step``, ``step + 1``, ... forever (this process's rows of each).

        With ``prefetch > 0`` a background thread keeps that many batches ready.
        """
        if self.prefetch <= 0:
            return self._sequential(step, process_index, process_count)
        return _Prefetcher(
            lambda k: self.batch(k, process_index, process_count), step, self.prefetch
        )

    def _sequential(self, step: int, process_index: int, process_count: int):
        while True:
            yield self.batch(step, process_index, process_count)
            step += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_from(0)


class _Prefetcher:
    """Iterates ``make(step), make(step + 1), ...`` computed ahead on a daemon thread."""

    def __init__(self, make, step: int, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(make, step), daemon=True, name="loader"
        )
        self._thread.start()

    def _run(self, make, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (make(step), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                item = (None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return
            step += 1

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        batch, error = self._queue.get()
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        """Stop the background thread."""
        self._stop.set()

    def __del__(self):
        self._stop.set()


def eval_batches(
    windows: TokenWindows, batch_size: int, max_batches: int | None = None
) -> list[np.ndarray]:
    """Validation batches in order, without shuffling: `(batch_size, seq_len)` int32 arrays.

    The windows after the last whole batch are dropped, except that with fewer windows
    than `batch_size` the result is one smaller batch holding all of them. At most
    `max_batches` batches are returned (all if None).
    """
    if len(windows) == 0:
        raise DataSourceError(
            f"no validation windows ({windows.num_tokens} tokens, seq_len {windows.seq_len})"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
    if len(windows) < batch_size:
        return [windows.get_batch(np.arange(len(windows)))]
    num_batches = len(windows) // batch_size
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return [
        windows.get_batch(np.arange(i * batch_size, (i + 1) * batch_size))
        for i in range(num_batches)
    ]
