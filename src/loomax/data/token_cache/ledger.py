"""The state of a build at the cache URL: claiming it, reading the ledger, cleaning up.

`build.json` says which settings the place belongs to; `ledger/<i>.json` which shards are
done. Both are checked against the build's fingerprint, so entries of other settings
never count. Pieces are deleted once the cache is complete. Damage is mended where that
is safe: an entry that does not parse, or whose piece is gone, does not count (its shard
is tokenized again), and a `meta.json` that does not parse beside a `build.json` of
these settings is deleted (the cache is rebuilt); otherwise it is refused with the fix.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import tensorstore as ts

from loomax.data.token_cache.damage import DAMAGED, damaged, read_record
from loomax.data.token_cache.layout import BUILD_FILE, META_FILE, TokenCacheError, split_names
from loomax.data.token_cache.settings import BuildPlan
from loomax.storage import CONTEXT, Directory, join, local_path

logger = logging.getLogger(__name__)


def claim(
    build: BuildPlan, overwrite: bool, before_repair: Callable[[str], None] = lambda why: None
) -> dict | None:
    """Checks what is at the cache URL: the meta of a complete, matching cache, or None.

    Refuses a cache (complete or not) built with other settings unless `overwrite`, and
    anything that is not a token cache. Records the settings in `build.json`.
    `before_repair(why)` is called before a complete cache is deleted to be rebuilt (it
    raises when this process may not: it does not hold the cache's build lease).
    """
    root = build.root
    meta, started = read_record(root, META_FILE), read_record(root, BUILD_FILE)
    if meta is DAMAGED:
        if started is DAMAGED or (started or {}).get("fingerprint") != build.key:
            raise damaged(root, str(root.child(META_FILE)), "not JSON")
        before_repair(f"{META_FILE} is not JSON")
        logger.warning("token cache %s: %s is not JSON: rebuilding the cache", root, META_FILE)
        root.delete(first=META_FILE)
        meta = started = None
    if started is DAMAGED and meta is None:  # safe: ledger entries name their own settings
        logger.warning("token cache %s: %s is not JSON: writing it again", root, BUILD_FILE)
        started = {"fingerprint": build.key}
    found = meta or started
    if found is None:
        if not _is_empty(root):
            raise TokenCacheError(
                f"token cache: {root} is not empty and holds no token cache "
                f"(no {META_FILE} or {BUILD_FILE}); give an empty or new path"
            )
    elif found.get("fingerprint") == build.key:
        if meta is not None:
            return meta
    elif not overwrite:
        raise TokenCacheError(
            f"token cache: {root} was built with other settings "
            f"({_difference(found.get('settings', {}), build.settings)}); give a new path "
            "(e.g. named by cache_fingerprint), or overwrite=True to delete it and rebuild"
        )
    else:
        before_repair("--overwrite")
        root.delete(first=META_FILE)
    root.write_json(BUILD_FILE, {"fingerprint": build.key, "settings": build.settings})
    return None


def _is_empty(root: Directory) -> bool:
    path = local_path(root.url)
    if path is not None:
        return not os.path.isdir(path) or not os.listdir(path)
    return not root.keys()


def _difference(cached: dict, wanted: dict) -> str:
    """What differs between two settings records, briefly, e.g. `bos: cache false, now true`."""
    parts = []
    for name in sorted(set(cached) | set(wanted)):
        old, new = cached.get(name), wanted.get(name)
        if old == new:
            continue
        if isinstance(old, list) and isinstance(new, list):
            pairs = enumerate(zip(old, new, strict=False))
            index = next((i for i, (a, b) in pairs if a != b), None)
            detail = f"{len(old)} entries, now {len(new)}"
            if index is not None:
                detail += f"; first difference at [{index}]: {old[index]!r}, now {new[index]!r}"
            parts.append(f"{name}: {detail}")
        else:
            parts.append(f"{name}: cache {json.dumps(old)}, now {json.dumps(new)}")
    return "; ".join(parts)


def read_ledger(build: BuildPlan) -> dict[int, dict]:
    """The ledger entries of this build (same fingerprint and shard name), by position.

    An entry that does not parse, or whose piece is not all there, is deleted: its shard is
    tokenized again (a piece is written before its entry, so this is damage)."""
    store = ts.KvStore.open(join(build.root.url, "ledger") + "/", context=CONTEXT).result()
    keys = [key.decode() for key in store.list().result()]
    reads = [(key, store.read(key)) for key in keys if key.removesuffix(".json").isdigit()]
    pieces = set(build.root.child("pieces").keys())
    ledger, damaged_keys = {}, []
    for key, read in reads:  # all reads are in flight at once
        result = read.result()
        position = int(key.removesuffix(".json"))
        if result.state != "value" or position >= len(build.shards):
            continue
        try:
            entry = json.loads(bytes(result.value))
        except (UnicodeDecodeError, json.JSONDecodeError):
            logger.warning("token cache %s: ledger/%s is not JSON: retokenizing", build.root, key)
            damaged_keys.append(key)
            continue
        if (
            entry.get("fingerprint") == build.key
            and entry.get("name") == build.shards[position].name
        ):
            if not _piece_is_there(build, entry, pieces):
                logger.warning(
                    "token cache %s: the piece of ledger/%s is gone: retokenizing", build.root, key
                )
                damaged_keys.append(key)
                continue
            ledger[position] = entry
    for key in damaged_keys:  # else a task would find and return the entry
        store.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    return ledger


def _piece_is_there(build: BuildPlan, entry: dict, pieces: set[str]) -> bool:
    """Whether every array of the entry's piece has its metadata (`zarr.json`) in `pieces`."""
    return all(
        f"{entry['position']}/{entry['piece']}/{split}/{array}/zarr.json" in pieces
        for split in split_names(build.holdout["fraction"])
        for array in ("tokens", "offsets")
    )


def entry_tokens(entry: dict) -> int:
    """Tokens a ledger entry's shard holds, over all splits."""
    return sum(split["tokens"] for split in entry["splits"].values())


def pieces_left(root: Directory) -> bool:
    """Whether any piece is still stored (a local folder is checked without listing it)."""
    pieces = root.child("pieces")
    path = local_path(pieces.url)
    if path is not None:
        return os.path.isdir(path) and bool(os.listdir(path))
    return bool(pieces.keys())


def delete_pieces(root: Directory) -> None:
    """Deletes every piece (once the cache is complete, they are copied)."""
    pieces = root.child("pieces")
    path = local_path(pieces.url)
    if path is None or os.path.isdir(path):
        pieces.delete()
