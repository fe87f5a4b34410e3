"""Finishing a build: the pieces of the shards used copied into the flat arrays, `meta.json`
written last, the pieces deleted; each write fenced on the build's lease.

Under a lease (`lease.BuildLease`: a cache several runs share) every write of this phase is
preceded by `check` (this process still holds the lease by its own count), and the two
commits, writing `meta.json` and deleting the pieces, by `confirm` (a compare-and-swap
proving in the store that the lease still holds this owner and fence). A holder that
stalled past its lease, or was replaced, so stops before it writes over its successor's
work. Without a lease (a single user: `build_token_cache` called directly) nothing is checked.
"""

from __future__ import annotations

from collections.abc import Callable

from loomax.data.token_cache.assemble import assemble_splits
from loomax.data.token_cache.damage import reading, stored_files
from loomax.data.token_cache.layout import FORMAT_VERSION, META_FILE
from loomax.data.token_cache.lease import BuildLease
from loomax.data.token_cache.ledger import delete_pieces
from loomax.data.token_cache.settings import BuildPlan, SplitInfo, TokenCacheInfo
from loomax.storage import Directory


def fences(lease: BuildLease | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """`(check, confirm)` of `lease`: called before each write, and before each commit."""
    if lease is None:
        return (lambda: None), (lambda: None)
    return lease.check, lease.confirm


def finish(build: BuildPlan, ledger: dict[int, dict], lease: BuildLease | None) -> dict:
    """Copies the pieces of the shards used into the flat arrays, then writes `meta.json`."""
    check, confirm = fences(lease)
    confirm()
    used = build.shards_used(ledger)
    assert used is not None, "every shard used is in the ledger"
    entries = [ledger[position] for position in range(used)]
    with reading(build.root, f"a piece under {build.root.child('pieces')}"):
        splits = assemble_splits(build, entries, check)
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": build.key,
        "settings": build.settings,
        "tokenizer": str(build.tokenizer_file),
        **build.token_ids,
        "splits": splits,
        "shards": {
            "total": len(build.shards),
            "used": used,
            "documents": {entry["name"]: entry["documents"] for entry in entries},
        },
        "documents_skipped": sum(entry["skipped"] for entry in entries),
        "skipped_examples": [e for entry in entries for e in entry["skipped_examples"]][:10],
        "files": stored_files(build.root, list(splits)),
    }
    confirm()  # the commit: only while the store still shows this owner's fence
    build.root.write_json(META_FILE, meta)
    return meta


def clean_up(root: Directory, lease: BuildLease | None) -> None:
    """Deletes the pieces of a complete cache, while the lease (if any) is still held."""
    fences(lease)[1]()
    delete_pieces(root)


def info(root: Directory, meta: dict, tokenized: list[dict]) -> TokenCacheInfo:
    """What the cache of `meta` holds, and what this call tokenized (`tokenized` entries)."""
    nodes: dict[str, int] = {}
    for entry in tokenized:
        if entry.get("node") is not None:
            nodes[entry["node"]] = nodes.get(entry["node"], 0) + 1
    return TokenCacheInfo(
        url=root.url,
        fingerprint=meta["fingerprint"],
        splits={name: SplitInfo(**counts) for name, counts in meta["splits"].items()},
        documents_skipped=meta["documents_skipped"],
        shards_total=meta["shards"]["total"],
        shards_used=meta["shards"]["used"],
        shards_tokenized=len(tokenized),
        skipped_examples=list(meta.get("skipped_examples", [])),
        shard_documents=dict(meta["shards"].get("documents", {})),
        nodes=nodes,
    )
