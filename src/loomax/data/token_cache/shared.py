"""One cache, many runs: `build_shared` builds a token cache under its lease, or waits.

Runs (or hosts) that point at the same cache call `build_shared`: the one that takes the
lease (`lease`) builds; the others wait, polling, until the cache is complete, or until
the lease expires (its builder was killed), when one of them takes it over and resumes
the build from the ledger. The ledger already makes a build resumable at any moment;
the lease keeps two builders from tokenizing the same shards at the same time.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from loomax.data.sources import Shard
from loomax.data.token_cache.build import BuildStopped, build_token_cache
from loomax.data.token_cache.layout import META_FILE
from loomax.data.token_cache.lease import LEASE_TTL_S, BuildLease
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
    **build: Any,
) -> TokenCacheInfo:
    """`build_token_cache(shards, tokenizer_path, cache_url, **build)` under the cache's lease.

    Builds when this process gets the lease; otherwise waits for the holder, saying so
    once, and takes over when its lease expires. A complete cache is returned as is.
    Raises `BuildStopped` when `should_stop` says so (while building or waiting).
    """
    url = to_url(cache_url)
    root, lease = Directory(url), BuildLease(url, lease_ttl_s)
    stop = should_stop or (lambda: False)
    waiting_since: float | None = None
    while True:
        if root.exists(META_FILE):  # complete: checked and returned, nothing to build
            return build_token_cache(shards, tokenizer_path, url, **build)
        if not lease.acquire():
            if waiting_since is None:
                waiting_since = time.monotonic()
                holder = lease.holder() or {}
                logger.info(
                    "token cache %s is being built by %s (pid %s): waiting for it "
                    "(its lease expires %.0f s after its last renewal)",
                    display(url),
                    holder.get("host", "another process"),
                    holder.get("pid", "?"),
                    lease_ttl_s,
                )
            if stop():
                raise BuildStopped("token cache: stopped while waiting for another builder")
            time.sleep(poll_s)
            continue
        if waiting_since is not None:
            logger.info(
                "token cache %s: the other builder's lease expired after %.0f s of waiting; "
                "resuming its build here",
                display(url),
                time.monotonic() - waiting_since,
            )
        with lease.held():
            try:
                return build_token_cache(
                    shards,
                    tokenizer_path,
                    url,
                    should_stop=lambda: lease.lost.is_set() or stop(),
                    **build,
                )
            except BuildStopped:
                if stop() or not lease.lost.is_set():
                    raise
                logger.warning("token cache %s: lost the build lease; waiting", display(url))
                waiting_since = time.monotonic()
