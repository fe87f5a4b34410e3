"""The state of a build at the cache URL: claiming it, reading the ledger, cleaning up.

`build.json` says which settings the place belongs to; `ledger/<i>.json` which shards are
done. Both are checked against the build's fingerprint, so entries of other settings
never count. Pieces are deleted once the cache is complete.
"""

from __future__ import annotations

import json
import os

import tensorstore as ts

from loomax.data.token_cache.layout import BUILD_FILE, META_FILE, TokenCacheError
from loomax.data.token_cache.settings import BuildPlan
from loomax.storage import CONTEXT, Directory, join, local_path


def claim(build: BuildPlan, overwrite: bool) -> dict | None:
    """Checks what is at the cache URL: the meta of a complete, matching cache, or None.

    Refuses a cache (complete or not) built with other settings unless `overwrite`, and
    anything that is not a token cache. Records the settings in `build.json`.
    """
    root = build.root
    found = root.read_json(META_FILE) or root.read_json(BUILD_FILE)
    if found is None:
        if not _is_empty(root):
            raise TokenCacheError(
                f"token cache: {root} is not empty and holds no token cache "
                f"(no {META_FILE} or {BUILD_FILE}); give an empty or new path"
            )
    elif found.get("fingerprint") == build.key:
        return root.read_json(META_FILE)
    elif not overwrite:
        raise TokenCacheError(
            f"token cache: {root} was built with other settings "
            f"({_difference(found.get('settings', {}), build.settings)}); give a new path "
            "(e.g. named by cache_fingerprint), or overwrite=True to delete it and rebuild"
        )
    else:
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
    """The ledger entries of this build (same fingerprint and shard name), by position."""
    store = ts.KvStore.open(join(build.root.url, "ledger") + "/", context=CONTEXT).result()
    keys = [key.decode() for key in store.list().result()]
    reads = [(key, store.read(key)) for key in keys if key.removesuffix(".json").isdigit()]
    ledger = {}
    for key, read in reads:  # all reads are in flight at once
        result = read.result()
        position = int(key.removesuffix(".json"))
        if result.state != "value" or position >= len(build.shards):
            continue
        entry = json.loads(bytes(result.value))
        if (
            entry.get("fingerprint") == build.key
            and entry.get("name") == build.shards[position].name
        ):
            ledger[position] = entry
    return ledger


def entry_tokens(entry: dict) -> int:
    """Tokens a ledger entry's shard holds, over all splits."""
    return sum(split["tokens"] for split in entry["splits"].values())


def delete_pieces(root: Directory) -> None:
    """Deletes every piece (once the cache is complete, they are copied)."""
    pieces = root.child("pieces")
    path = local_path(pieces.url)
    if path is None or os.path.isdir(path):
        pieces.delete()
