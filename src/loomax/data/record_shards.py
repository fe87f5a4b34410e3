"""A source read as one stream and cut, as it is read, into logical shards of N records.

For a source too large to list up front (a streamed Hugging Face dataset, a long run of
URLs): `source.records_per_shard` makes logical shard `k` the records
`[k*N, (k+1)*N)` of the source's document stream, in its usual order. Their number is
learned when the stream ends (the first shard holding fewer than N records is the last),
so a build reads the stream once, in order, and hands each logical shard to a worker;
a resumed build reads the stream again and skips the shards its ledger holds. A shard's
name (`<source>:records[a:b]`) depends only on the source and its index.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import overload

from loomax.data.hf_datasets import hf_label
from loomax.data.readers import ReadStats
from loomax.data.sources import Shard, SourceConfig, iter_documents


class RecordShards(Sequence[Shard]):
    """The logical shards of a `records_per_shard` source; its length is unknown (huge)
    until `end` is learned from the stream or from a ledger."""

    def __init__(self, source: SourceConfig) -> None:
        if source.records_per_shard is None:
            raise ValueError("data source: RecordShards needs `records_per_shard`")
        self.source = source
        self.size: int = source.records_per_shard
        self.end: int | None = None
        """How many logical shards there are, once known."""

    @property
    def label(self) -> str:
        """Names the source: its `hf` dataset, embedded corpus or URLs."""
        source = self.source
        if source.hf is not None:
            return hf_label(source.hf)
        return f"embedded:{source.embedded}" if source.embedded else ",".join(source.urls)

    @property
    def description(self) -> str:
        """What the cache's settings record instead of every shard's name."""
        return f"{self.label}:every {self.size} records"

    def __len__(self) -> int:
        return self.end if self.end is not None else sys.maxsize

    @overload
    def __getitem__(self, index: int) -> Shard: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Shard]: ...
    def __getitem__(self, index: int | slice) -> Shard | Sequence[Shard]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.size
        name = f"{self.label}:records[{start}:{start + self.size}]"
        return Shard(self.source, index, name, ())

    def __iter__(self) -> Iterator[Shard]:
        if self.end is None:
            raise TypeError(f"{self.description}: the number of shards is not known yet")
        return (self[i] for i in range(self.end))

    def learn_end(self, ledger: dict[int, dict]) -> None:
        """Sets `end` from ledger entries: the first shard recorded with fewer than N records."""
        short = [position for position, e in ledger.items() if e["documents"] < self.size]
        if short:
            self.end = min(short) + 1

    @property
    def names(self) -> RecordShardNames:
        """The shards' names, as a reader of the growing cache needs them (open-ended)."""
        return RecordShardNames(self)

    def read(
        self, *, skip_bad_records: bool = False, max_documents: int | None = None
    ) -> Iterator[tuple[int, tuple[str, ...], int]]:
        """`(index, documents, bad records skipped)` of each logical shard, in order, reading
        the source once; sets `end` when the stream ends (the last shard may be empty)."""
        stats = ReadStats()
        documents = iter_documents(self.source, skip_bad_records=skip_bad_records, stats=stats)
        limit = max_documents
        index = 0
        while True:
            skipped = stats.skipped
            want = self.size if limit is None else min(self.size, limit - index * self.size)
            batch = tuple(itertools.islice(documents, max(0, want)))
            if len(batch) < self.size:
                self.end = index + 1
            yield index, batch, stats.skipped - skipped
            if self.end is not None:
                return
            index += 1


class RecordShardNames(Sequence[str]):
    """The names of `shards`' logical shards, for a reader of their cache while it builds
    (`GrowingCache`): its length is unknown (huge) until `learn_end` finds the last shard
    in the ledger (or the build's reading of the stream does)."""

    def __init__(self, shards: RecordShards) -> None:
        self.shards = shards

    @property
    def end(self) -> int | None:
        """How many shards there are, once known."""
        return self.shards.end

    def learn_end(self, ledger: dict[int, dict]) -> None:
        """`RecordShards.learn_end`: the end, from the ledger entries read so far."""
        self.shards.learn_end(ledger)

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.shards[index].name
