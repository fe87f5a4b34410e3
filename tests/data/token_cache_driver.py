"""Builds a token cache in a process of its own, so a test can kill it (not a test itself).

Usage: python token_cache_driver.py '{"urls": [...], "tokenizer": ..., "cache": ...,
"address": ..., "sleep": seconds}': every shard's task sleeps that long before it starts.
"""

import json
import sys
import time

from loomax.data.sources import Shard, SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.distributed import RayConfig


def sleeping(seconds: float):
    """A `before_piece` that slows every shard's task by `seconds`."""

    def before_piece(shard: Shard) -> None:
        time.sleep(seconds)

    return before_piece


def main() -> None:
    args = json.loads(sys.argv[1])
    build_token_cache(
        source_shards(SourceConfig(urls=args["urls"])),
        args["tokenizer"],
        args["cache"],
        ray_config=RayConfig(address=args["address"]),
        progress=False,
        before_piece=sleeping(args.get("sleep", 0.0)),
    )


if __name__ == "__main__":
    main()
