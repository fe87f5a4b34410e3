"""The token cache: documents tokenized in parallel by Ray into flat tensorstore arrays.

`build_token_cache` builds (or resumes) one; `TokenCache.open` reads a finished one.
Modules, one job each: `layout` (what is stored where, the arrays), `settings` (what a
cache depends on, its fingerprint), `tasks` (one shard into one piece: what a Ray task
runs), `ledger` (the build's state at the cache URL), `assemble` (pieces into flat
splits), `build` (the orchestration), `reader` (reading a finished cache; no Ray).
"""

from loomax.data.token_cache.build import build_token_cache
from loomax.data.token_cache.layout import TokenCacheError, is_held_out
from loomax.data.token_cache.reader import TokenCache
from loomax.data.token_cache.settings import TokenCacheInfo, cache_fingerprint

__all__ = [
    "TokenCache",
    "TokenCacheError",
    "TokenCacheInfo",
    "build_token_cache",
    "cache_fingerprint",
    "is_held_out",
]
