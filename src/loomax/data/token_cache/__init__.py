"""The token cache: documents tokenized in parallel by Ray into flat tensorstore arrays.

`build_token_cache` builds (or resumes) one; `TokenCache.open` reads a finished one.
Modules, one job each: `layout` (what is stored where, the arrays), `settings` (what a
cache depends on, its fingerprint), `tasks` (one shard into one piece: what a Ray task
runs), `ledger` (the build's state at the cache URL), `damage` (finding damaged
files), `assemble` (pieces into flat splits), `build` (the orchestration), `reader`
(reading a finished cache; no Ray).
The names below are imported on first use, so a Ray worker importing `tasks` does not
import `build`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomax.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from loomax.data.token_cache.build import build_token_cache
    from loomax.data.token_cache.layout import TokenCacheDamaged, TokenCacheError, is_held_out
    from loomax.data.token_cache.reader import TokenCache
    from loomax.data.token_cache.settings import TokenCacheInfo, cache_fingerprint

_EXPORTS = {
    "TokenCache": "loomax.data.token_cache.reader",
    "TokenCacheDamaged": "loomax.data.token_cache.layout",
    "TokenCacheError": "loomax.data.token_cache.layout",
    "TokenCacheInfo": "loomax.data.token_cache.settings",
    "build_token_cache": "loomax.data.token_cache.build",
    "cache_fingerprint": "loomax.data.token_cache.settings",
    "is_held_out": "loomax.data.token_cache.layout",
}

__all__ = [
    "TokenCache",
    "TokenCacheDamaged",
    "TokenCacheError",
    "TokenCacheInfo",
    "build_token_cache",
    "cache_fingerprint",
    "is_held_out",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
