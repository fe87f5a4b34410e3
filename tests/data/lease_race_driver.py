"""One of several real processes building one token cache under its lease (not a test itself).

Usage: python lease_race_driver.py '{"urls": [...], "tokenizer": ..., "cache": ...,
"lease_ttl": s, "poll": s, "marks": dir, "points": [...], "stall": bool, "out": dir}'.

It runs `build_shared` on local files (tokenized in this process: a tiny corpus, no Ray)
and stops at each of `points` the first time any of the processes reaches it (the first to
create `<marks>/<point>` with its pid in it): `shard:<k>` before shard k is tokenized (in
its task), `assemble` between the train and validation splits being assembled, `commit` just
before `meta.json` is written, `clean` after it and before the pieces are deleted. There
it sleeps until killed, or with `stall`, until `<marks>/<point>.go` exists (a test stops
it with SIGSTOP meanwhile: a hung holder). When the build returns, it writes to
`<out>/<pid>.json` a digest of the first batches of the cache in both orders (the global
shuffle, and the chunked order of `stream_while_building`).
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from loomax.data.growing_windows import GrowingWindows
from loomax.data.loader import BatchLoader
from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import TokenCache, assemble, finish
from loomax.data.token_cache.partial import GrowingCache
from loomax.data.token_cache.shared import build_shared
from loomax.data.windows import SplitWindows

SEQ_LEN, BATCH, STEPS = 8, 4, 12
HOLDOUT = 0.1


def pauser(marks: Path, stall: bool, points: set[str]):
    """`pause(point)`: stops this process at `point` if it is the first to get there."""

    def pause(point: str) -> None:
        if point not in points:
            return
        try:
            fd = os.open(marks / point, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another process stopped here first
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while not (stall and (marks / f"{point}.go").exists()):
            time.sleep(0.02)

    return pause


def batches_digest(cache: str, key: str, names: list[str]) -> str:
    """sha256 of the first batches in the global order and in the chunked (streamed) one."""
    digest = hashlib.sha256()
    split = SplitWindows(TokenCache.open(cache)["train"], SEQ_LEN)
    growing = GrowingWindows(GrowingCache(cache, key, names), SEQ_LEN, 2, "data.train[0]")
    growing.refresh()
    for windows in (split, growing):
        loader = BatchLoader(windows, BATCH, seed=1, prefetch=0)
        for step in range(STEPS):
            digest.update(loader.batch(step).tobytes())
    return digest.hexdigest()


def main() -> None:
    args = json.loads(sys.argv[1])
    pause = pauser(Path(args["marks"]), args.get("stall", False), set(args["points"]))
    real_create, creates = assemble.create_array, []

    def create(directory, dtype, size):
        creates.append(directory)
        if len(creates) == 3:  # the train split assembled, the validation split not yet
            pause("assemble")
        return real_create(directory, dtype, size)

    real_files, real_delete = finish.stored_files, finish.delete_pieces

    def files_then_commit(root, splits):
        found = real_files(root, splits)
        pause("commit")
        return found

    def clean(root):
        pause("clean")
        real_delete(root)

    assemble.create_array, finish.stored_files, finish.delete_pieces = (
        create,
        files_then_commit,
        clean,
    )
    shards = source_shards(SourceConfig(urls=args["urls"]))
    info = build_shared(
        shards,
        args["tokenizer"],
        args["cache"],
        lease_ttl_s=args["lease_ttl"],
        poll_s=args["poll"],
        holdout_fraction=HOLDOUT,
        progress=False,
        before_piece=lambda shard: pause(f"shard:{shard.index}"),
    )
    names = [shard.name for shard in shards]
    result = {"digest": batches_digest(args["cache"], info.fingerprint, names)}
    Path(args["out"], f"{os.getpid()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
