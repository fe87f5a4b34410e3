"""The build lease: which process builds a token cache that several runs share.

The lease is a small JSON record beside the cache folder (`<cache>.lease.json`: owner,
host, pid, a fencing number `fence` and a renewal count `beat`), changed only by
compare-and-swap writes of the kvstore (tensorstore's `if_equal` generation: an atomic
create on local disks, a conditional write on GCS/S3).

- **Expiry by missed renewals, not clocks.** The holder renews (`beat` + 1) every
  `ttl_s / 3` seconds from a thread. A waiter takes the lease over only when it has seen
  the same record, unrenewed, for `ttl_s` seconds of its *own* monotonic clock; no two
  hosts' clocks are ever compared. The holder counts its lease from just before its last
  confirmed write and stops writing `MARGIN` of `ttl_s` before that runs out, so it has
  stopped before any waiter, who saw that write later, can take over. One exception needs
  no clock: a record written on this host by a process that no longer runs (a run killed
  on the same machine) is taken over at once, not after its TTL.
- **Renewals retried.** A store error in a renewal is retried until the lease would run
  out; then it is marked lost and the holder stops, loudly (an error in the log).
- **Fenced.** Every take-over raises `fence`; a release keeps it (the record stays, with
  no owner), so it never goes back. The finish phase of a build calls `check` before each
  write and `confirm` (a compare-and-swap that the record still holds this owner and
  fence) at its commit; Ray tasks are given the fence and record a shard only while the
  lease still holds it (`fence_holds`), so the tasks of a stopped or replaced holder stop
  writing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import tensorstore as ts

from loomax.data.token_cache.layout import TokenCacheError
from loomax.storage import CONTEXT, display, to_url

logger = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
"""Seconds a lease holds after its last renewal (as seen by the waiters' own clocks)."""

MARGIN = 0.25
"""Share of the TTL before its end at which the holder stops writing: the slack for one
write in flight and for the clocks' rates (not their readings) to differ."""

_FAILED = b""
"""The generation a conditional write returns when its condition did not hold."""


class LeaseLost(TokenCacheError):
    """This process no longer holds (or can no longer prove it holds) a cache's build lease."""


def _running(pid: object) -> bool:
    """Whether process ``pid`` of this host runs (True when unknown: then the TTL decides)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it runs
        return True
    return True


def lease_key(cache_url: str) -> tuple[str, str]:
    """The folder and key of the lease of the cache at `cache_url` (beside the cache)."""
    parent, _, name = cache_url.rstrip("/").rpartition("/")
    return parent + "/", f"{name}.lease.json"


def read_lease(cache_url: str) -> dict | None:
    """The lease record of the cache at `cache_url` (with or without an owner), or None."""
    folder, key = lease_key(to_url(cache_url))
    result = ts.KvStore.open(folder, context=CONTEXT).result().read(key).result()
    return json.loads(bytes(result.value)) if result.state == "value" else None


def fence_holds(cache_url: str, fence: int | None) -> bool:
    """Whether the lease of the cache at `cache_url` is still held at `fence` (None: the
    build runs without a lease, nothing to check)."""
    if fence is None:
        return True
    record = read_lease(cache_url)
    return record is not None and record.get("owner") is not None and record["fence"] == fence


class BuildLease:
    """The lease on building the cache at `cache_url`, as seen by one owner (this process)."""

    def __init__(
        self, cache_url: str | os.PathLike, ttl_s: float = LEASE_TTL_S, owner: str | None = None
    ):
        self.cache_url = to_url(cache_url)
        folder, self.key = lease_key(self.cache_url)
        self._store = ts.KvStore.open(folder, context=CONTEXT).result()
        self.ttl_s = ttl_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lost = threading.Event()
        """Set when this owner lost the lease: taken by another, or its renewals failed."""
        self.fence: int | None = None
        """The fencing number of the lease while this owner holds it."""
        self._beat = 0
        self._confirmed_at = float("-inf")  # monotonic time just before the last good write
        self._seen: tuple[tuple, float] | None = None  # another's record, first seen when
        self._writing = threading.Lock()  # the renewal thread and `confirm` take turns

    def holder(self) -> dict | None:
        """The current holder's record (`owner`, `host`, `pid`, `fence`, `beat`), or None."""
        record = self._read()[0]
        return record if record is not None and record.get("owner") is not None else None

    def _read(self) -> tuple[dict | None, bytes]:
        result = self._store.read(self.key).result()
        record = json.loads(bytes(result.value)) if result.state == "value" else None
        return record, result.stamp.generation

    def _write(self, generation: bytes, record: dict) -> bool:
        written = self._store.write(self.key, json.dumps(record).encode(), if_equal=generation)
        return written.result().generation != _FAILED

    def _record(self, fence: int, beat: int) -> dict:
        return {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "fence": fence,
            "beat": beat,
            "ttl_s": self.ttl_s,
            "written_at": time.time(),  # for people reading it; never compared
        }

    def _expired(self, record: dict) -> bool:
        """Whether another owner's `record` went unrenewed for its TTL on this clock, or was
        written on this host by a process that has ended (whose tasks the fence stops)."""
        if record.get("host") == socket.gethostname() and not _running(record.get("pid")):
            return True
        # `expires`: a record of an older loomax, renewed by rewriting it
        seen = tuple(record.get(key) for key in ("owner", "fence", "beat", "expires"))
        now = time.monotonic()
        if self._seen is None or self._seen[0] != seen:
            self._seen = (seen, now)
            return False
        return now - self._seen[1] >= float(record.get("ttl_s", self.ttl_s))

    def acquire(self) -> bool:
        """Takes the lease if it is free, unrenewed for its TTL, or already ours (raising
        its fence when it changes hands); whether this owner holds it."""
        record, generation = self._read()
        owner = None if record is None else record.get("owner")
        if owner is not None and owner != self.owner and not self._expired(record):
            return False
        previous = 0 if record is None else int(record.get("fence", 0))
        fence = previous if owner == self.owner else previous + 1
        started = time.monotonic()
        if not self._write(generation, self._record(fence, 0)):
            return False
        self.fence, self._beat, self._confirmed_at, self._seen = fence, 0, started, None
        self.lost.clear()
        return True

    def renew(self) -> bool:
        """Extends the lease (a compare-and-swap on this owner and fence); sets `lost` and
        returns False if another owner holds it. Store errors are raised."""
        with self._writing:  # two renewals at once would fail each other's compare-and-swap
            started = time.monotonic()
            record, generation = self._read()
            ours = record is not None and (record.get("owner"), record.get("fence")) == (
                self.owner,
                self.fence,
            )
            if not ours or not self._write(generation, self._record(self.fence, self._beat + 1)):
                self.lost.set()
                return False
            self._beat += 1
            self._confirmed_at = started
            return True

    def remaining_s(self) -> float:
        """Seconds this owner may still write before it must have renewed."""
        return (1 - MARGIN) * self.ttl_s - (time.monotonic() - self._confirmed_at)

    def check(self) -> None:
        """Raises `LeaseLost` unless this owner still holds the lease, as far as it knows
        without asking the store (called before each write of a build's finish phase)."""
        if not self.lost.is_set() and self.remaining_s() <= 0:
            self.lost.set()
        if self.lost.is_set():
            raise LeaseLost(f"token cache {display(self.cache_url)}: the build lease was lost")

    def confirm(self) -> None:
        """Renews the lease, proving in the store that this owner and fence still hold it
        (before a commit); raises `LeaseLost` if not."""
        self.check()
        try:
            renewed = self.renew()
        except ValueError as error:  # a store error: we cannot prove it, so we do not commit
            raise LeaseLost(
                f"token cache: the build lease could not be confirmed: {error}"
            ) from error
        if not renewed:
            raise LeaseLost(
                f"token cache {display(self.cache_url)}: the build lease was taken over "
                f"(by {(self.holder() or {}).get('owner', 'nobody')})"
            )

    def release(self) -> None:
        """Gives the lease up, if this owner still holds it; the record stays, ownerless, so
        its fence never goes back."""
        record, generation = self._read()
        if record is not None and record.get("owner") == self.owner:
            released = {"owner": None, "fence": record.get("fence", 0), "beat": 0}
            self._store.write(self.key, json.dumps(released).encode(), if_equal=generation).result()
        self.fence = None

    def _keep_renewing(self, done: threading.Event) -> None:
        """Renews every `ttl_s / 3`; retries store errors every `ttl_s / 12` while the lease
        lasts, then gives up loudly (sets `lost`: the build stops)."""
        every, retry = self.ttl_s / 3, self.ttl_s / 12
        wait, failures = every, 0
        while not done.wait(wait):
            try:
                if not self.renew():
                    logger.warning(
                        "token cache %s: the build lease was taken over by %s; stopping",
                        display(self.cache_url),
                        (self.holder() or {}).get("owner", "another run"),
                    )
                    return
                wait, failures = every, 0
            except Exception as error:  # noqa: BLE001 - a store error: retried
                failures += 1
                if self.remaining_s() <= retry:
                    self.lost.set()
                    logger.error(
                        "token cache %s: giving up the build lease after %d failed renewals "
                        "(%s: %s); this run stops building it",
                        display(self.cache_url),
                        failures,
                        type(error).__name__,
                        error,
                    )
                    return
                logger.warning(
                    "token cache %s: renewing the build lease failed (%s); retrying",
                    display(self.cache_url),
                    error,
                )
                wait = retry

    @contextlib.contextmanager
    def held(self) -> Iterator[BuildLease]:
        """Renews the (acquired) lease from a thread for the block, then releases it."""
        done = threading.Event()
        thread = threading.Thread(
            target=self._keep_renewing, args=(done,), daemon=True, name="cache-lease"
        )
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            with contextlib.suppress(ValueError):  # unreachable store: the lease runs out
                self.release()
