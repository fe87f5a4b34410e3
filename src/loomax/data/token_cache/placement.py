"""Where a build's shards are tokenized: on Ray, or in this process when Ray would cost
more than it saves (a `memory://` cache Ray workers cannot see, or a small local corpus
with no Ray running: starting a local cluster takes 3-30 s, tokenizing 8 MiB a few)."""

from __future__ import annotations

import os
import sys

from loomax.data.record_shards import RecordShards
from loomax.data.token_cache.settings import BuildPlan
from loomax.distributed import RayConfig

SMALL_BUILD_BYTES = 8 << 20
"""Local files up to this many bytes in all are tokenized in this process when no Ray
is running and no cluster address is given."""


def runs_here(build: BuildPlan, ray_config: RayConfig) -> bool:
    """Whether `build` tokenizes in this process rather than on Ray."""
    if build.root.url.startswith("memory://"):
        return True
    ray = sys.modules.get("ray")  # importing Ray to ask costs seconds
    if ray is not None and ray.is_initialized():
        return False
    if ray_config.address is not None or os.environ.get("RAY_ADDRESS"):
        return False
    if isinstance(build.shards, RecordShards):
        return False
    total = 0
    for shard in build.shards:
        if shard.source.hf is not None:
            return False
        for path in shard.paths:
            if "://" in path and not path.startswith("file://"):
                return False
            total += os.path.getsize(path.removeprefix("file://"))
            if total > SMALL_BUILD_BYTES:
                return False
    return True
