"""Damaged cache files: found cheaply by their record, or by tensorstore's checksums on read.

`stored_files` records, when a build finishes, every file of the flat arrays and (for
local caches) its size; `find_damage` compares the cache against that record (a listing,
no data read), so a removed or truncated file is found before a run starts. An
overwritten byte keeps the size: the CRC-32C of its chunk fails the read, and `reading`
turns that tensorstore error into a `TokenCacheDamaged` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loomax.data.token_cache.layout import TokenCacheDamaged
from loomax.storage import Directory, local_path

_TENSORSTORE_ERROR = re.compile(r"^[A-Z_]+: ")
"""How tensorstore's errors begin (`DATA_LOSS: `, `NOT_FOUND: `...): raised as ValueError."""

DAMAGED = object()
"""What `read_record` returns for a file that is there but is not JSON."""


def fix(root: Directory) -> str:
    """What to do about a damaged cache at `root`."""
    return (
        f"delete {root} and rerun `loomax cache` (or `loomax train`, which rebuilds a "
        "damaged cache it finds before training)"
    )


def damaged(root: Directory, what: str, why: str) -> TokenCacheDamaged:
    """The error for `what` (a file or array of the cache at `root`) being damaged."""
    why = " ".join(why.split(" [tensorstore_spec=")[0].split())
    return TokenCacheDamaged(f"token cache: {what} is damaged ({why}); {fix(root)}", root.url)


@contextmanager
def reading(root: Directory, what: str) -> Iterator[None]:
    """Turns tensorstore's errors inside (a failed checksum, a missing or short file) into
    `TokenCacheDamaged` naming `what`, the cache at `root` and the fix."""
    try:
        yield
    except ValueError as error:
        if not _TENSORSTORE_ERROR.match(str(error)):
            raise
        raise damaged(root, what, str(error)) from error


def read_record(root: Directory, key: str) -> Any:
    """The JSON at `key`: None if it is missing, `DAMAGED` if it does not parse."""
    data = root.read_bytes(key)
    if data is None:
        return None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return DAMAGED


def stored_files(root: Directory, splits: list[str]) -> dict[str, int | None]:
    """Every file of the splits' arrays, relative to `root`: its size in bytes for a local
    cache, None elsewhere (a listing of other stores has no sizes)."""
    path = local_path(root.url)
    files: dict[str, int | None] = {}
    for split in splits:
        for key in root.child(split).keys():
            name = f"{split}/{key}"
            files[name] = os.path.getsize(os.path.join(path, name)) if path else None
    return dict(sorted(files.items()))


def find_damage(root: Directory, meta: dict) -> str | None:
    """What is wrong with the files of a complete cache (by its meta's record), or None."""
    recorded: dict[str, int | None] = meta.get("files", {})
    found = stored_files(root, list(meta.get("splits", {})))
    for name, size in recorded.items():
        if name not in found:
            return f"{root.child(name)} is missing"
        if size is not None and found[name] != size:
            return f"{root.child(name)} has {found[name]:,} bytes, {size:,} when it was written"
    return None
