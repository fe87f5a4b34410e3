"""The build lease: which process builds a token cache that several runs share.

The lease is a small JSON record beside the cache folder (`<cache>.lease.json`: owner,
host, pid and an expiry time), changed only by compare-and-swap writes of the kvstore
(tensorstore's `if_equal` generation: an atomic create on local disks, a conditional
write on GCS/S3). The holder renews it every `ttl_s / 3` seconds from a thread; another
process takes it only when it is absent or expired, so a builder that was killed (or
hangs past its expiry) is replaced, and a holder that finds its lease taken stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import tensorstore as ts

from loomax.storage import CONTEXT, to_url

LEASE_TTL_S = 60.0
"""Seconds a lease holds after its last renewal."""

_FAILED = b""
"""The generation a conditional write returns when its condition did not hold."""


def lease_key(cache_url: str) -> tuple[str, str]:
    """The folder and key of the lease of the cache at `cache_url` (beside the cache)."""
    parent, _, name = cache_url.rstrip("/").rpartition("/")
    return parent + "/", f"{name}.lease.json"


class BuildLease:
    """The lease on building the cache at `cache_url`, as seen by one owner (this process)."""

    def __init__(
        self, cache_url: str | os.PathLike, ttl_s: float = LEASE_TTL_S, owner: str | None = None
    ):
        folder, self.key = lease_key(to_url(cache_url))
        self._store = ts.KvStore.open(folder, context=CONTEXT).result()
        self.ttl_s = ttl_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lost = threading.Event()
        """Set when a renewal found the lease taken by another owner (this one must stop)."""

    def holder(self) -> dict | None:
        """The current record (`owner`, `host`, `pid`, `expires`), or None when there is none."""
        return self._read()[0]

    def _read(self) -> tuple[dict | None, bytes]:
        result = self._store.read(self.key).result()
        record = json.loads(bytes(result.value)) if result.state == "value" else None
        return record, result.stamp.generation

    def _write(self, generation: bytes) -> bool:
        record = {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "expires": time.time() + self.ttl_s,
        }
        written = self._store.write(self.key, json.dumps(record).encode(), if_equal=generation)
        return written.result().generation != _FAILED

    def acquire(self) -> bool:
        """Takes the lease if it is free, expired or already ours; whether this owner holds it."""
        record, generation = self._read()
        if record is not None and record["owner"] != self.owner:
            if record["expires"] > time.time():
                return False
        if self._write(generation):
            self.lost.clear()
            return True
        return False

    def renew(self) -> bool:
        """Extends the lease; sets `lost` (and returns False) if another owner holds it."""
        record, generation = self._read()
        if record is None or record["owner"] != self.owner or not self._write(generation):
            self.lost.set()
            return False
        return True

    def release(self) -> None:
        """Gives the lease up, if this owner still holds it."""
        record, generation = self._read()
        if record is not None and record["owner"] == self.owner:
            self._store.write(self.key, None, if_equal=generation).result()

    @contextlib.contextmanager
    def held(self) -> Iterator[BuildLease]:
        """Renews the (acquired) lease from a thread for the block, then releases it."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.ttl_s / 3):
                if not self.renew():
                    return

        thread = threading.Thread(target=renew, daemon=True, name="cache-lease")
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            self.release()
