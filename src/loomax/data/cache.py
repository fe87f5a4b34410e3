"""The local token cache: token streams saved as .npy files under a fingerprinted folder.

A cache entry is a folder named by a fingerprint of everything its contents depend on.
Each array is written to a temporary name and renamed into place, and `meta.json` is
written last, so an entry is complete exactly when its `meta.json` exists; a crashed or
concurrent writer never leaves a half-written entry that a reader would use.
"""

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

META_FILE = "meta.json"
"""Written last; marks a cache entry as complete and records what it holds."""


def fingerprint(record: object) -> str:
    """A short hex digest of a JSON-serializable record (keys sorted, so order-free)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 hex digest of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_token_streams(entry: Path, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays `names` of a complete cache entry, or None if the entry is not complete."""
    if not (entry / META_FILE).is_file():
        return None
    return {name: np.load(entry / f"{name}.npy", allow_pickle=False) for name in names}


def save_token_streams(entry: Path, streams: dict[str, np.ndarray], metadata: dict) -> None:
    """Writes each stream to `<entry>/<name>.npy`, then `meta.json` with `metadata`."""
    entry.mkdir(parents=True, exist_ok=True)
    for name, array in streams.items():
        _write_atomically(
            entry / f"{name}.npy", lambda f, a=array: np.save(f, a, allow_pickle=False)
        )
    text = json.dumps(metadata, indent=2, sort_keys=True).encode()
    _write_atomically(entry / META_FILE, lambda f: f.write(text))


def _write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Calls `write(file)` on a temporary file next to `path`, then renames it to `path`."""
    tmp_path = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp_path.open("wb") as file:
            write(file)
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
