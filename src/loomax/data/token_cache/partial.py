"""Reading a token cache while it is built: shard by shard, from the ledger and its pieces.

A shard is readable once its ledger entry exists (the entry is written after the piece is
complete). Its tokens are read from its piece while the build runs, and from the flat
split arrays once `meta.json` exists (the build then deletes the pieces). A read from a
piece counts only if `meta.json` was still absent after it: the pieces are deleted only
after `meta.json` is written, so such a read saw a whole piece; otherwise it is read
again from the flat array, where the shard starts after the train tokens of the shards
before it. So is a piece that cannot be opened any more, once `meta.json` is there. A
damaged piece or flat array (a failed checksum, a missing or short file) raises
`TokenCacheDamaged` naming it and the fix, as `reader` does.
Needs only tensorstore, like `reader`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from loomax.data.token_cache.damage import reading
from loomax.data.token_cache.layout import META_FILE, TokenCacheDamaged, open_array, piece_dir
from loomax.storage import CONTEXT, Directory, join, to_url


class GrowingCache:
    """The shards of the cache at `url` (of fingerprint `key`) that are done, readable by split.

    `names` are the build's shard names in order (an entry counts only under its own name
    and fingerprint, as in the build's ledger). For a source cut into logical shards as
    it is read (`records_per_shard`) they are open-ended: a sequence whose `learn_end`
    finds their number in the ledger entries, `end` None until then.
    """

    def __init__(self, url: str | os.PathLike, key: str, names: Sequence[str]) -> None:
        self.root = Directory(to_url(url))
        self.key = key
        self.names = names if hasattr(names, "learn_end") else list(names)  # open-ended: as is
        self.entries: dict[int, dict] = {}
        self.complete = False
        self._arrays: dict[tuple, ts.TensorStore] = {}
        self._offsets: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def num_shards(self) -> int:
        """How many shards the cache has (huge while an open-ended count is not known)."""
        return len(self.names)

    @property
    def num_shards_known(self) -> bool:
        """Whether `num_shards` is the count (false while open-ended names lack their end)."""
        return getattr(self.names, "end", 0) is not None

    def refresh(self) -> dict[int, dict]:
        """Reads the ledger entries not seen before; returns all entries so far, by position."""
        store = ts.KvStore.open(join(self.root.url, "ledger") + "/", context=CONTEXT).result()
        keys = [key.decode() for key in store.list().result()]
        wanted = [k for k in keys if k.removesuffix(".json").isdigit()]
        reads = [
            (int(k.removesuffix(".json")), store.read(k))
            for k in wanted
            if int(k.removesuffix(".json")) not in self.entries
        ]
        for position, read in reads:
            result = read.result()
            if result.state != "value" or position >= len(self.names):
                continue
            entry = json.loads(bytes(result.value))
            if entry.get("fingerprint") == self.key and entry.get("name") == self.names[position]:
                with self._lock:
                    self.entries[position] = entry
        if not self.num_shards_known:
            self.names.learn_end(self.entries)  # type: ignore[attr-defined]
        if not self.complete:
            self._check_complete()
        return dict(self.entries)

    def _check_complete(self) -> bool:
        if not self.complete and self.root.exists(META_FILE):
            self.complete = True
        return self.complete

    def tokens(self, position: int, split: str = "train") -> int:
        """Tokens of `split` in the shard at `position` (which must be done)."""
        return int(self.entries[position]["splits"].get(split, {"tokens": 0})["tokens"])

    def read(
        self, ranges: Sequence[tuple[int, int, int]], split: str = "train"
    ) -> list[np.ndarray]:
        """The tokens `[start, stop)` of `split` of each `(position, start, stop)` (shards done)."""
        if not self.complete:
            try:
                got = self._read_pieces(ranges, split)
            except (TokenCacheDamaged, ValueError):  # a piece gone: meta.json written since?
                if not self._check_complete():
                    raise
            else:
                if not self._check_complete():  # the pieces were whole during the reads
                    return got
        base = self._flat_offsets(split)
        directory = self.root.child(split, "tokens")
        with reading(self.root, str(directory)):
            flat = self._array(("flat", split), directory)
            futures = [flat[base[p] + a : base[p] + b].read() for p, a, b in ranges]
            return [future.result() for future in futures]

    def _read_pieces(self, ranges: Sequence[tuple[int, int, int]], split: str) -> list[np.ndarray]:
        """The ranges read from the shards' pieces, all at once; `TokenCacheDamaged` naming
        the first piece that fails (a failed checksum, a missing or short file)."""
        reads = []
        for position, start, stop in ranges:
            directory = self._piece_dir(position, split)
            with reading(self.root, str(directory)):
                reads.append((directory, self._piece(position, split)[start:stop].read()))
        got = []
        for directory, future in reads:
            with reading(self.root, str(directory)):
                got.append(future.result())
        return got

    def _flat_offsets(self, split: str) -> list[int]:
        """Where each shard's tokens start in the flat `split` (every shard is done by now)."""
        if split not in self._offsets:
            if len(self.entries) < len(self.names):
                self.refresh()
            offsets, total = [], 0
            for position in range(len(self.names)):
                offsets.append(total)
                total += self.tokens(position, split)
            self._offsets[split] = offsets
        return self._offsets[split]

    def _piece_dir(self, position: int, split: str) -> Directory:
        """The directory of the tokens of `split` in the piece of the shard at `position`."""
        attempt = self.entries[position]["piece"]
        return piece_dir(self.root, position, attempt, split).child("tokens")

    def _piece(self, position: int, split: str) -> ts.TensorStore:
        key = ("piece", position, self.entries[position]["piece"], split)
        return self._array(key, self._piece_dir(position, split))

    def _array(self, key: tuple, directory: Directory) -> ts.TensorStore:
        with self._lock:
            array = self._arrays.get(key)
            if array is None:
                array = self._arrays[key] = open_array(directory)
            return array
