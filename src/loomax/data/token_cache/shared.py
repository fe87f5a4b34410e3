"""One cache, many runs: `build_shared` builds a token cache under its lease, or waits.

Runs (or hosts) that point at the same cache call `build_shared`: the one that takes the
lease (`lease`) builds; the others wait, polling, until the cache is complete, or until
the lease goes unrenewed for its TTL (its builder was killed or hangs), when one of them
takes it over and resumes the build from the ledger. The ledger already makes a build
resumable at any moment; the lease keeps two builders from tokenizing the same shards at
the same time, and fences the finish phase (`finish`) so a replaced builder writes
nothing more. A complete cache is read without the lease; one that needs a repair (it is
damaged, or its pieces were left by a builder killed after its commit) is repaired only
under the lease.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from loomax.data.sources import Shard
from loomax.data.token_cache.build import BuildStopped, CacheNeedsRepair, build_token_cache
from loomax.data.token_cache.layout import META_FILE
from loomax.data.token_cache.lease import LEASE_TTL_S, BuildLease, LeaseLost
from loomax.data.token_cache.settings import TokenCacheInfo
from loomax.storage import Directory, display, to_url

logger = logging.getLogger(__name__)

POLL_S = 2.0
"""Seconds between looks at a cache another process builds."""


def build_shared(
    shards: Sequence[Shard],
    tokenizer_path: str | os.PathLike,
    cache_url: str | os.PathLike,
    *,
    lease_ttl_s: float = LEASE_TTL_S,
    poll_s: float = POLL_S,
    should_stop: Callable[[], bool] | None = None,
    rebuild: bool = False,
    **build: Any,
) -> TokenCacheInfo:
    """`build_token_cache(shards, tokenizer_path, cache_url, **build)` under the cache's lease.

    Builds when this process gets the lease; otherwise waits for the holder, saying so
    once, and takes over when its lease goes unrenewed. A complete cache is returned as is
    (repaired under the lease if it needs it). `rebuild` (a read found the complete cache
    damaged) deletes its `meta.json` under the lease first, and rebuilds it.
    Raises `BuildStopped` when `should_stop` says so (while building or waiting).
    """
    url = to_url(cache_url)
    root, lease = Directory(url), BuildLease(url, lease_ttl_s)
    stop = should_stop or (lambda: False)
    waiting_since: float | None = None
    while True:
        if not rebuild and root.exists(META_FILE):  # complete: checked, read without the lease
            try:
                return build_token_cache(shards, tokenizer_path, url, repair=False, **build)
            except CacheNeedsRepair as why:
                logger.info("%s: taking its build lease to repair it", why)
        if not lease.acquire():
            if waiting_since is None:
                waiting_since = time.monotonic()
                holder = lease.holder() or {}
                logger.info(
                    "token cache %s is being built by %s (pid %s): waiting for it "
                    "(taken over if its lease goes unrenewed for %.0f s)",
                    display(url),
                    holder.get("host", "another process"),
                    holder.get("pid", "?"),
                    float(holder.get("ttl_s", lease_ttl_s)),
                )
            if stop():
                raise BuildStopped("token cache: stopped while waiting for another builder")
            time.sleep(poll_s)
            continue
        if waiting_since is not None:
            logger.info(
                "token cache %s: the other builder's lease went unrenewed (after %.0f s of "
                "waiting); resuming its build here (lease fence %s)",
                display(url),
                time.monotonic() - waiting_since,
                lease.fence,
            )
        with lease.held():
            try:
                if rebuild:
                    lease.confirm()
                    root.delete(first=META_FILE)
                    rebuild = False
                return build_token_cache(
                    shards,
                    tokenizer_path,
                    url,
                    should_stop=lambda: lease.lost.is_set() or stop(),
                    lease=lease,
                    **build,
                )
            except (BuildStopped, LeaseLost):
                if stop() or not _lost(lease):
                    raise
                logger.warning("token cache %s: lost the build lease; waiting", display(url))
                waiting_since = time.monotonic()


def _lost(lease: BuildLease) -> bool:
    """Whether `lease` is lost (a task may see its fence move on before the renewals do)."""
    if not lease.lost.is_set():
        try:
            lease.confirm()
        except LeaseLost:
            return True
    return lease.lost.is_set()
