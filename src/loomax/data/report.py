"""What the data path skipped or found empty, said plainly.

Bad records skipped under `data.skip_bad_records` become per-source lines to print and
summary values for the run's tracker (`data/skipped_records/<source>`); a source with too
few tokens is named with its files, and which of them hold no documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

SHOWN_EXAMPLES = 3
"""Skipped records shown per source (file and line, and the reason)."""

SHOWN_FILES = 5
"""Files named per source in an error before `... and N more`."""


@dataclass(frozen=True)
class SkippedRecords:
    """The bad records one source's token cache skipped."""

    source: str
    """The source, as the config names it: `data.train[0]`."""
    count: int
    examples: list[str] = field(default_factory=list)
    """The first few, each `file, line N: reason`."""

    @property
    def summary_key(self) -> str:
        """Its key in the run's summary: `data/skipped_records/train[0]`."""
        return "data/skipped_records/" + self.source.removeprefix("data.")


class _CacheInfo(Protocol):
    documents_skipped: int
    skipped_examples: list[str]


class _Summary(Protocol):
    def log_summary(self, summary: dict[str, Any]) -> None: ...


def skipped_records(kind: str, infos: Sequence[_CacheInfo]) -> list[SkippedRecords]:
    """One `SkippedRecords` per cache of the `data.<kind>` sources (`TokenCacheInfo`s)."""
    return [
        SkippedRecords(f"data.{kind}[{i}]", info.documents_skipped, list(info.skipped_examples))
        for i, info in enumerate(infos)
    ]


def skipped_lines(skipped: Sequence[SkippedRecords]) -> list[str]:
    """Lines telling how many records each source skipped, with the first examples;
    none for sources that skipped nothing."""
    lines = []
    for source in skipped:
        if source.count:
            lines.append(f"{source.source}: {source.count:,} bad record(s) skipped, first:")
            lines += [f"  {example}" for example in source.examples[:SHOWN_EXAMPLES]]
    return lines


def skipped_summary(skipped: Sequence[SkippedRecords]) -> dict[str, int]:
    """`{"data/skipped_records/<source>": count}` for every source, 0 included."""
    return {source.summary_key: source.count for source in skipped}


def report_skipped(skipped: Sequence[SkippedRecords], tracker: _Summary, *, echo: bool) -> None:
    """Records the skipped counts in the run's summary; prints them if `echo` and any."""
    tracker.log_summary(skipped_summary(skipped))
    if echo:
        for line in skipped_lines(skipped):
            print(line)


def describe_shards(shard_documents: dict[str, int], *, noun: str = "files") -> str:
    """`its 2 files: a.jsonl (empty), b.txt (3 documents)`, the empty ones named first."""
    if not shard_documents:  # a cache built before per-shard counts were recorded
        return f"its {noun}: not recorded in its cache (rebuild it to see them)"
    empty = [name for name, count in shard_documents.items() if count == 0]
    full = [(name, count) for name, count in shard_documents.items() if count]
    parts = [f"{name} (empty: no documents)" for name in empty]
    parts += [f"{name} ({count:,} document{'s' if count > 1 else ''})" for name, count in full]
    more = len(parts) - SHOWN_FILES
    text = ", ".join(parts[:SHOWN_FILES]) + (f" and {more} more" if more > 0 else "")
    total = len(shard_documents)
    if total == 1:
        return f"its only {noun.removesuffix('s')}: {text}"
    if empty:
        return f"{len(empty)} of its {total} {noun} hold no documents: {text}"
    return f"its {total} {noun}: {text}"
