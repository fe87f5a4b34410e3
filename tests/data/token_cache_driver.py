"""Builds a token cache in a process of its own, so a test can kill it (not a test itself).

Usage: python token_cache_driver.py '{"urls": [...], "tokenizer": ..., "cache": ...,
"address": ..., "sleep": seconds, "marks": dir, "lease_ttl": seconds}': every shard's task
sleeps that long before it starts; with `marks`, it first writes a file there naming its Ray
node and the node's `LOOMAX_TEST_NODE` (which a test sets on each node it starts); with
`lease_ttl`, it builds under the cache's lease (`build_shared`) of that many seconds; with
`in_process`, shard by shard in this process instead of on Ray (`in_process_builds`).
"""

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

from loomax.data.sources import Shard, SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.data.token_cache.shared import build_shared
from loomax.distributed import RayConfig


def sleeping(seconds: float, marks: str | None = None):
    """A `before_piece` that slows every shard's task by `seconds` (and marks its node)."""

    def before_piece(shard: Shard) -> None:
        if marks is not None:
            import ray

            node = ray.get_runtime_context().get_node_id()
            role = os.environ.get("LOOMAX_TEST_NODE", "?")
            Path(marks, f"{shard.index}-{time.monotonic_ns()}").write_text(f"{node} {role}")
        time.sleep(seconds)

    return before_piece


def in_process_builds(monkeypatch_setattr=setattr) -> None:
    """Makes builds of local caches run in this process, one shard after another, as builds
    of `memory://` caches do (the Ray build itself is tested elsewhere): for tests of what
    is around it (leases, kills) that need no Ray's start-up."""
    from loomax.data.token_cache import build

    monkeypatch_setattr(build, "_run_on_ray", build._run_here)
    monkeypatch_setattr(build, "ray_session", lambda config: contextlib.nullcontext())


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("in_process"):
        in_process_builds()
    build = build_token_cache
    if "lease_ttl" in args:
        build = functools.partial(build_shared, lease_ttl_s=args["lease_ttl"])
    build(
        source_shards(SourceConfig(urls=args["urls"])),
        args["tokenizer"],
        args["cache"],
        ray_config=RayConfig(address=args["address"]),
        progress=False,
        before_piece=sleeping(args.get("sleep", 0.0), args.get("marks")),
    )


if __name__ == "__main__":
    main()
