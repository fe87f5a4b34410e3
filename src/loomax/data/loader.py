"""Batches of windows: a deterministic, resumable training stream and fixed eval batches."""

from collections.abc import Iterator

import numpy as np

from loomax.data.windows import TokenWindows


def process_rows(num_rows: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of a global batch that process `process_index` holds."""
    share, rem = divmod(num_rows, process_count)
    if rem:
        raise ValueError(
            f"a batch of {num_rows} rows does not split over {process_count} processes"
        )
    return slice(process_index * share, (process_index + 1) * share)


class BatchLoader:
    """Training batches addressed by step, so resuming at any step needs no replay.

    The windows are read in a stream made of one permutation per epoch, concatenated;
    epoch `e` uses the permutation drawn from `np.random.default_rng([seed, e])` (or the
    identity if `shuffle` is off). Batch `step` is stream positions
    `[step * batch_size, (step + 1) * batch_size)`, so a batch may span two epochs, and a
    batch larger than the dataset simply spans several.
    """

    def __init__(
        self, windows: TokenWindows, batch_size: int, seed: int, shuffle: bool = True
    ) -> None:
        if len(windows) == 0:
            raise ValueError(
                f"cannot load batches from zero windows ({windows.num_tokens} tokens, "
                f"seq_len {windows.seq_len})"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The window indices of epoch `epoch`, in the order they are read."""
        order = self._permutations.get(epoch)
        if order is None:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
            else:
                order = np.arange(len(self.windows))
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = order
        return order

    def batch_indices(self, step: int) -> np.ndarray:
        """The window indices of batch `step` (step 0 is the first batch)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        num_windows = len(self.windows)
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, offsets = np.divmod(positions, num_windows)
        indices = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            indices[in_epoch] = self.epoch_order(int(epoch))[offsets[in_epoch]]
        return indices

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Batch `step` as an int32 array of shape `(batch_size, seq_len)`.

        With `process_count > 1`, only this process's contiguous share of the rows,
        `(batch_size / process_count, seq_len)`: the other rows are never read.
        """
        indices = self.batch_indices(step)[
            process_rows(self.batch_size, process_index, process_count)
        ]
        return self.windows.get_batch(indices)

    def iter_from(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[np.ndarray]:
        """Yields batch `step`, `step + 1`, ... forever (this process's rows of each)."""
        while True:
            yield self.batch(step, process_index, process_count)
            step += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_from(0)


def eval_batches(
    windows: TokenWindows, batch_size: int, max_batches: int | None = None
) -> list[np.ndarray]:
    """Validation batches in order, without shuffling: `(batch_size, seq_len)` int32 arrays.

    The windows after the last whole batch are dropped, except that with fewer windows
    than `batch_size` the result is one smaller batch holding all of them. At most
    `max_batches` batches are returned (all if None).
    """
    if len(windows) == 0:
        raise ValueError(
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
