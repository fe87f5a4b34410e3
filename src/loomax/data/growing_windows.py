"""Training windows over a token cache that may still be building, in a chunked order.

The shards (in their order in the source) are grouped into chunks of `chunk_shards`.
Each chunk's train tokens, its shards' back to back, are cut into `seq_len` windows (the
tail of a chunk is not used). Sample `j` of the dataset is in the chunk whose windows
hold it, counting chunk by chunk in order, and within the chunk it is window
`perm(j - chunk start)`, a Feistel permutation keyed by (seed, dataset, epoch, chunk).
A chunk's windows depend only on its own shards, so the samples of the chunks built so
far never change as later chunks arrive: the order is a pure function of the config
and the sample number, whether the cache was complete or still building when the run
started. The epoch length (all windows) is needed only past the first epoch, when the
cache is complete. A sample in a chunk not built yet waits for it, saying so in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from loomax.data.permutation import FeistelPermutation
from loomax.data.token_cache.partial import GrowingCache
from loomax.errors import DataSourceError
from loomax.storage import local_path

logger = logging.getLogger(__name__)

CHUNK_MEMORY_BYTES = 256 << 20
"""Chunks up to this size are read into memory whole (two kept); larger ones per window."""


LOCAL_POLL_S = 0.1
"""Seconds between looks at a local cache's ledger while waiting for a chunk."""
REMOTE_POLL_S = 1.0
"""Seconds between looks at a cache's ledger on an object store (gs://, s3://)."""


class GrowingWindows:
    """Windows of `seq_len` tokens over the chunks of `cache` built so far (see the module).

    `name` (e.g. `data.train[0]`) labels its log lines; `failure` returns the error of
    the build feeding the cache, if it failed, so a wait ends with it instead of hanging.
    A wait looks at the ledger every `poll_s` seconds: by default 0.1 s on a local disk
    (or in memory: a listing; the first step starts within 0.1 s of its chunk, not up to 1 s after) and
    1 s on object stores (a paid request each).
    """

    def __init__(
        self,
        cache: GrowingCache,
        seq_len: int,
        chunk_shards: int,
        name: str,
        *,
        failure: Callable[[], BaseException | None] = lambda: None,
        poll_s: float | None = None,
        say_every_s: float = 10.0,
        chunk_memory_bytes: int = CHUNK_MEMORY_BYTES,
    ) -> None:
        if chunk_shards < 1:
            raise ValueError(f"chunk_shards must be >= 1, got {chunk_shards}")
        self.cache, self.seq_len, self.chunk_shards, self.name = cache, seq_len, chunk_shards, name
        if poll_s is None:
            local = local_path(cache.root.url) is not None or cache.root.url.startswith("memory://")
            poll_s = LOCAL_POLL_S if local else REMOTE_POLL_S
        self._failure, self._poll_s, self._say_every_s = failure, poll_s, say_every_s
        self._memory_bytes = chunk_memory_bytes
        self._starts = [0]  # first window of each chunk known so far, then the total
        self._lock = threading.RLock()
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()

    # ---------------------------------------------------------------- what is built
    def chunk_shards_of(self, chunk: int) -> range:
        """Positions of the shards of `chunk`."""
        return range(
            chunk * self.chunk_shards, min((chunk + 1) * self.chunk_shards, self.cache.num_shards)
        )

    @property
    def num_chunks(self) -> int:
        """Chunks of the cache (huge until the number of shards is known: `records_per_shard`)."""
        return -(-self.cache.num_shards // self.chunk_shards)

    @property
    def chunks_ready(self) -> int:
        return len(self._starts) - 1

    @property
    def complete(self) -> bool:
        """Whether every chunk is built (the epoch length is known)."""
        return self.chunks_ready == self.num_chunks

    @property
    def first_chunk_windows(self) -> int:
        """Windows of the first chunk (once it is built)."""
        return self._starts[1] if len(self._starts) > 1 else 0

    def __len__(self) -> int:
        """Windows in the chunks built so far (all of them once `complete`)."""
        return self._starts[-1]

    def refresh(self) -> int:
        """Reads the ledger and adds the chunks now whole, in order; the windows known."""
        with self._lock:
            if not self.complete:
                entries = self.cache.refresh()
                while not self.complete:
                    shards = self.chunk_shards_of(self.chunks_ready)
                    if any(p not in entries for p in shards):
                        break
                    tokens = sum(self.cache.tokens(p) for p in shards)
                    self._starts.append(self._starts[-1] + tokens // self.seq_len)
            return len(self)

    def progress(self) -> str:
        """How far the build is, for the log: shards and tokens done, chunks ready."""
        done = self.cache.entries
        tokens = sum(self.cache.tokens(p) for p in done)
        if self.cache.num_shards_known:
            share = len(done) / max(1, self.cache.num_shards)
            shards = f"{len(done)}/{self.cache.num_shards} shards tokenized ({share:.0%})"
            chunks = f"{self.chunks_ready}/{self.num_chunks}"
        else:  # a source cut into shards as it is read: its end is not known yet
            shards, chunks = f"{len(done)} shards tokenized (of a stream)", f"{self.chunks_ready}"
        return (
            f"{shards}, {tokens:,} train tokens; {chunks} chunks of "
            f"{self.chunk_shards} shards ready ({len(self):,} windows)"
        )

    def wait_for(self, windows: int) -> None:
        """Returns once `windows` windows are known or the cache is complete; logs while waiting."""
        if len(self) >= windows or self.complete:
            return
        start = time.monotonic()
        said = start - self._say_every_s  # say so at once, then every say_every_s
        while self.refresh() < windows and not self.complete:
            error = self._failure()
            if error is not None:
                raise error
            now = time.monotonic()
            if now - said >= self._say_every_s:
                said = now
                logger.info(
                    "%s: waiting %.0f s for the token cache (needs window %d, in chunk %d): %s",
                    self.name,
                    now - start,
                    windows - 1,
                    self.chunks_ready,
                    self.progress(),
                )
            time.sleep(self._poll_s)
        if len(self) == 0:
            raise DataSourceError(
                f"{self.name} has fewer than seq_len={self.seq_len} tokens in every chunk of "
                f"{self.chunk_shards} shards: no window to train on; add documents or lower "
                "`model.seq_len`"
            )

    def hold_out_first_chunk_tail(self, windows: int) -> np.ndarray:
        """Takes the last `windows` windows of the first chunk (built) out of training, for
        validation; returns their tokens. Call it before reading any batch."""
        with self._lock:
            first = self._starts[1]
            if not 0 <= windows <= first:
                raise ValueError(f"cannot hold out {windows} of {first} windows")
            held = self.get_batch(np.arange(first - windows, first)).reshape(-1)
            self._starts = [0] + [start - windows for start in self._starts[1:]]
            self._chunks.clear()
        return held

    # ---------------------------------------------------------------- the order
    def sample_windows(
        self, dataset: int, samples: np.ndarray, seed: int, shuffle: bool
    ) -> np.ndarray:
        """Window ids of the dataset's samples `samples` (waits for the chunks they need)."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size == 0:
            return samples
        self.wait_for(int(samples.max()) + 1)
        starts = np.asarray(self._starts, dtype=np.int64)
        if len(self) > samples.max():
            epochs, offsets = np.zeros_like(samples), samples
        else:  # complete, and past the first epoch
            epochs, offsets = np.divmod(samples, len(self))
        chunks = np.searchsorted(starts, offsets, side="right") - 1
        local = offsets - starts[chunks]
        if shuffle:
            for epoch, chunk in {(int(e), int(c)) for e, c in zip(epochs, chunks, strict=True)}:
                mask = (epochs == epoch) & (chunks == chunk)
                size = int(starts[chunk + 1] - starts[chunk])
                perm = FeistelPermutation(size, [seed, "chunk", dataset, epoch, chunk])
                local[mask] = perm(local[mask])
        return starts[chunks] + local

    # ---------------------------------------------------------------- reading
    def get_batch(self, indices: np.ndarray) -> np.ndarray:
        """The windows of ids `indices` (from `sample_windows`), shape `(n, seq_len)` int32."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len), dtype=np.int32)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"window ids out of range for {len(self)} windows built")
        starts = np.asarray(self._starts, dtype=np.int64)
        chunks = np.searchsorted(starts, indices, side="right") - 1
        for chunk in np.unique(chunks):
            rows = np.flatnonzero(chunks == chunk)
            first = (indices[rows] - starts[chunk]) * self.seq_len
            out[rows] = self._read_chunk(int(chunk), first)
        return out

    def _read_chunk(self, chunk: int, firsts: np.ndarray) -> np.ndarray:
        """Windows of `chunk` starting at token offsets `firsts` of its stream."""
        shards = list(self.chunk_shards_of(chunk))
        sizes = [self.cache.tokens(p) for p in shards]
        if sum(sizes) * 4 <= self._memory_bytes:
            tokens = self._whole_chunk(chunk, shards, sizes)
            return np.stack([tokens[a : a + self.seq_len] for a in firsts])
        bounds = np.cumsum([0] + sizes)
        ranges, owners = [], []
        for row, a in enumerate(firsts):
            b = a + self.seq_len
            for i, p in enumerate(shards):
                lo, hi = max(a, bounds[i]), min(b, bounds[i + 1])
                if lo < hi:
                    ranges.append((p, int(lo - bounds[i]), int(hi - bounds[i])))
                    owners.append(row)
        pieces = self.cache.read(ranges)
        rows: list[list[np.ndarray]] = [[] for _ in firsts]
        for row, piece in zip(owners, pieces, strict=True):
            rows[row].append(piece)
        return np.stack([np.concatenate(parts) for parts in rows])

    def _whole_chunk(self, chunk: int, shards: list[int], sizes: list[int]) -> np.ndarray:
        with self._lock:
            tokens = self._chunks.get(chunk)
            if tokens is None:
                parts = self.cache.read([(p, 0, n) for p, n in zip(shards, sizes, strict=True)])
                tokens = np.concatenate(parts).astype(np.int32, copy=False)
                self._chunks[chunk] = tokens
                while len(self._chunks) > 2:
                    self._chunks.popitem(last=False)
            return tokens

    def __repr__(self) -> str:
        return f"GrowingWindows({self.name}, {self.progress()})"
