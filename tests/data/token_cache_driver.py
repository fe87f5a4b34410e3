"""Builds a token cache in a process of its own, so a test can kill it (not a test itself).

Usage: python token_cache_driver.py '{"urls": [...], "tokenizer": ..., "cache": ..., "address": ...}'
"""

import json
import sys

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.distributed import RayConfig


def main() -> None:
    args = json.loads(sys.argv[1])
    build_token_cache(
        source_shards(SourceConfig(urls=args["urls"])),
        args["tokenizer"],
        args["cache"],
        ray_config=RayConfig(address=args["address"]),
        progress=False,
    )


if __name__ == "__main__":
    main()
