"""Reading a finished token cache: `TokenCache.open(url)["train"].read(0, 2048)`.

Needs only tensorstore: neither Ray nor the build machinery is imported here. A damaged
file (missing, truncated, overwritten) raises `TokenCacheDamaged` naming it and the fix,
on opening (by the record of files in meta.json) or on the read that meets it (by the
chunks' checksums): damaged tokens are never returned.
"""

from __future__ import annotations

import os

import numpy as np

from loomax.data.token_cache.damage import DAMAGED, damaged, find_damage, read_record, reading
from loomax.data.token_cache.layout import FORMAT_VERSION, META_FILE, TokenCacheError, open_array
from loomax.storage import Directory, display, to_url


class TokenSplit:
    """One split of a finished cache: a flat token array and its document offsets."""

    def __init__(self, directory: Directory, documents: int, tokens: int) -> None:
        self._root = Directory(directory.url.rsplit("/", 1)[0])
        self._directory = directory
        with reading(self._root, str(directory)):
            self._tokens = open_array(directory.child("tokens"))
            self._offsets = open_array(directory.child("offsets"))
        for name, array, size in (
            ("tokens", self._tokens, tokens),
            ("offsets", self._offsets, documents + 1),
        ):
            if array.shape != (size,):
                raise damaged(
                    self._root,
                    str(directory.child(name)),
                    f"shape {list(array.shape)}, meta.json says [{size}]",
                )
        self.num_documents = documents
        self.num_tokens = tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start:stop` of the split as a new int32 array."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range {start}:{stop} out of range for {self.num_tokens}")
        with reading(self._root, str(self._directory.child("tokens"))):
            return self._tokens[start:stop].read().result()

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (with its EOS, and BOS if the cache has them)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.num_documents}")
        with reading(self._root, str(self._directory.child("offsets"))):
            start, stop = self._offsets[index : index + 2].read().result()
        return self.read(int(start), int(stop))

    def offsets(self) -> np.ndarray:
        """All document offsets, int64 of length `num_documents + 1`."""
        with reading(self._root, str(self._directory.child("offsets"))):
            return self._offsets.read().result()

    def as_numpy(self) -> np.ndarray:
        """The whole split in memory (for small caches)."""
        return self.read(0, self.num_tokens)


class TokenCache:
    """A finished token cache, opened for reading: `cache.splits["train"].read(0, 2048)`."""

    def __init__(self, url: str, meta: dict) -> None:
        self.url = url
        self.meta = meta
        root = Directory(url)
        self.splits = {
            name: TokenSplit(root.child(name), counts["documents"], counts["tokens"])
            for name, counts in meta["splits"].items()
        }

    @classmethod
    def open(cls, cache_url: str | os.PathLike) -> TokenCache:
        """Opens the cache at `cache_url`; `TokenCacheError` if it is missing or incomplete,
        `TokenCacheDamaged` if a file is missing or not the size it was written with."""
        root = Directory(to_url(cache_url))
        meta = read_record(root, META_FILE)
        if meta is DAMAGED:
            raise damaged(root, str(root.child(META_FILE)), "not JSON")
        if meta is None:
            raise TokenCacheError(
                f"token cache: {display(root.url)} has no {META_FILE}: it is missing or its "
                "build did not finish; run the build (again) to complete it"
            )
        if meta.get("format") != FORMAT_VERSION:
            raise TokenCacheError(
                f"token cache: {display(root.url)} has format {meta.get('format')}, "
                f"this version reads {FORMAT_VERSION}; rebuild it"
            )
        problem = find_damage(root, meta)
        if problem is not None:
            raise damaged(root, str(root), problem)
        return cls(root.url, meta)

    def __getitem__(self, split: str) -> TokenSplit:
        if split not in self.splits:
            raise KeyError(
                f"token cache {display(self.url)} has no split {split!r}: {list(self.splits)}"
            )
        return self.splits[split]
