"""Cache keys: short fingerprints of JSON records and of files' bytes."""

import hashlib
import json
from pathlib import Path


def fingerprint(record: object) -> str:
    """A short hex digest of a JSON-serializable record (keys sorted, so order-free)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 hex digest of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
