"""Where checkpoints and token caches live: a local directory or any tensorstore kvstore URL.

Every read, write, listing and deletion goes through a tensorstore ``KvStore``, so the
same code serves local paths, ``gs://``, ``s3://`` and ``memory://`` (used in tests).
Local paths get a few fast paths (directory listing, ``rmtree``) on top.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

CONTEXT = ts.Context()
"""One tensorstore context for every open, so pools, caches and ``memory://`` are shared."""

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def to_url(path: str | os.PathLike) -> str:
    """A kvstore URL for ``path``: URLs pass through, local paths become absolute ``file://``."""
    path = os.fspath(path)
    if _URL.match(path):
        return path.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(path))


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path components."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def local_path(url: str) -> str | None:
    """The filesystem path of a ``file://`` URL, else None."""
    return url[len("file://") :] if url.startswith("file://") else None


def display(url: str) -> str:
    """``url`` as a user wrote it: local paths without the scheme."""
    return local_path(url) or url


def _kvstore(url: str) -> ts.KvStore:
    # the trailing slash makes keys relative to the directory
    return ts.KvStore.open(url.rstrip("/") + "/", context=CONTEXT).result()


@dataclass(frozen=True)
class Directory:
    """A directory-like prefix in a key-value store, addressed by URL."""

    url: str

    def child(self, *parts: str) -> Directory:
        return Directory(join(self.url, *parts))

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return display(self.url)

    # ---------------------------------------------------------------- files
    def exists(self, key: str) -> bool:
        path = local_path(self.url)
        if path is not None:
            return os.path.isfile(os.path.join(path, key))
        return _kvstore(self.url).read(key).result().state == "value"

    def read_bytes(self, key: str) -> bytes | None:
        """The value at ``key``, or None if it does not exist."""
        result = _kvstore(self.url).read(key).result()
        return bytes(result.value) if result.state == "value" else None

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write ``key`` atomically (the store replaces the whole value at once)."""
        _kvstore(self.url).write(key, data).result()

    def read_json(self, key: str) -> Any | None:
        data = self.read_bytes(key)
        return None if data is None else json.loads(data)

    def write_json(self, key: str, value: Any) -> None:
        self.write_bytes(key, json.dumps(value, indent=2, sort_keys=True).encode())

    # ---------------------------------------------------------------- listings
    def keys(self) -> list[str]:
        """Every key under this directory, relative to it."""
        path = local_path(self.url)
        if path is not None:
            out = []
            for root, _, files in os.walk(path):
                rel = os.path.relpath(root, path)
                out.extend(f if rel == "." else f"{rel}/{f}" for f in files)
            return out
        return [k.decode() for k in _kvstore(self.url).list().result()]

    def subdirectories(self) -> list[str]:
        """Names of the immediate subdirectories (prefixes) that hold at least one key."""
        path = local_path(self.url)
        if path is not None:
            if not os.path.isdir(path):
                return []
            return [e.name for e in os.scandir(path) if e.is_dir()]
        return sorted({k.split("/", 1)[0] for k in self.keys() if "/" in k})

    # ---------------------------------------------------------------- changes
    def delete(self, *, first: str | None = None) -> None:
        """Delete everything under this directory; ``first`` (e.g. the commit marker) goes first.

        Removing the marker first means an interrupted delete never leaves something that
        looks complete.
        """
        store = _kvstore(self.url)
        if first is not None:
            store.delete_range(ts.KvStore.KeyRange(first, first + "\0")).result()
        path = local_path(self.url)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            store.delete_range(ts.KvStore.KeyRange()).result()

    def check_writable(self) -> None:
        """Write and delete a probe key; raises ``OSError`` naming the place if that fails."""
        key = f".write-test-{uuid.uuid4().hex}"
        try:
            path = local_path(self.url)
            if path is not None:
                os.makedirs(path, exist_ok=True)
            self.write_bytes(key, b"ok")
            _kvstore(self.url).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
        except (OSError, ValueError) as e:
            raise OSError(f"cannot write to {self}: {e}") from e
