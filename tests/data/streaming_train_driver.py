"""Runs `loomax train` on a cache still building in a process of its own, so a test can
kill it (not a test itself).

Usage: python streaming_train_driver.py '{"args": [...], "sleep": seconds}': `args` are the
`loomax train` overrides; the cache builds in this process shard by shard (no Ray, as
`token_cache_driver.in_process_builds`), every shard past the first two sleeping `sleep`
seconds first so training overtakes the build, and those from position `stall_from` (if
given) sleeping `stall` seconds instead: a run to be killed waits there, however late the
kill comes on a loaded machine. The build lease lasts 2 s, so a run after a killed one
takes the build over at once.
"""

import contextlib
import functools
import json
import sys
import time

from loomax.data import streaming
from loomax.data.background_build import BackgroundBuilds
from loomax.data.token_cache import build
from loomax.data.token_cache.shared import build_shared


def main() -> None:
    options = json.loads(sys.argv[1])
    tokenize = build.build_piece

    def slowed(job, tokenizer_json):
        if job.position >= options.get("stall_from", job.position + 1):
            time.sleep(options["stall"])
        elif job.position >= 2:
            time.sleep(options["sleep"])
        return tokenize(job, tokenizer_json)

    build.build_piece = slowed
    build._run_on_ray = build._run_here
    build.ray_session = lambda config: contextlib.nullcontext()
    BackgroundBuilds.ensure_ray = lambda self: None
    streaming.build_shared = functools.partial(build_shared, lease_ttl_s=2.0)
    from loomax.cli import main as loomax

    loomax(["train", *options["args"]])


if __name__ == "__main__":
    main()
