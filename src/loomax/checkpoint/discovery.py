"""Finding complete checkpoints on storage and reading them back."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from loomax.checkpoint.serialize import CheckpointError, check_chunks, read_tree
from loomax.storage import Directory, to_url

logger = logging.getLogger(__name__)

METADATA = "metadata.json"
"""The file whose presence makes a checkpoint complete; written last."""
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint found on storage."""

    step: int
    directory: Directory
    metadata: dict[str, Any]

    @property
    def permanent(self) -> bool:
        return bool(self.metadata.get("permanent", True))

    @property
    def pinned(self) -> bool:
        """Saved at one of ``fixed_steps`` or before the first step: never deleted."""
        return bool(self.metadata.get("pinned", False))

    @property
    def run_id(self) -> str | None:
        """The run that saved it (None for checkpoints older than the record)."""
        return self.metadata.get("run_id")

    def __str__(self) -> str:
        return str(self.directory)


def list_checkpoints(path: str) -> list[CheckpointInfo]:
    """Complete checkpoints at ``path``, oldest first.

    ``path`` is one checkpoint (it has ``metadata.json``) or a directory of ``step-N``
    checkpoints; directories without ``metadata.json`` are skipped.
    """
    root = Directory(to_url(path))
    meta = root.read_json(METADATA)
    if meta is not None:
        return [CheckpointInfo(int(meta["step"]), root, meta)]
    found = []
    for name in root.subdirectories():
        if not _STEP_DIR.fullmatch(name):
            continue
        directory = root.child(name)
        meta = directory.read_json(METADATA)
        if meta is None:
            logger.info("ignoring incomplete checkpoint %s (no %s)", directory, METADATA)
            continue
        found.append(CheckpointInfo(int(meta["step"]), directory, meta))
    return sorted(found, key=lambda c: c.step)


def load_checkpoint(
    checkpoint: CheckpointInfo, template: Any, shardings: Any, *, prefix: str | None = None
) -> tuple[Any, list[str]]:
    """Read ``template``'s leaves from ``checkpoint``; returns ``(tree, missing names)``.

    ``prefix`` reads only leaves under it (e.g. ``model``), the rest come back as None.
    Errors name the checkpoint and the array.
    """
    meta = checkpoint.metadata
    arrays = meta.get("arrays", {})
    values = meta.get("values", {})
    names = None
    if prefix is not None:
        names = {
            n for n in list(arrays) + list(values) if n == prefix or n.startswith(prefix + "/")
        }
        arrays = {n: e for n, e in arrays.items() if n in names}
    try:
        check_chunks(checkpoint.directory.url, checkpoint.directory.keys(), arrays)
        tree, missing = read_tree(
            checkpoint.directory.url, arrays, values, template, shardings, names=names
        )
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {checkpoint}: {e}") from e
    if prefix is not None:
        missing = [n for n in missing if n == prefix or n.startswith(prefix + "/")]
    return tree, missing


def load_latest(
    path: str,
    template: Any,
    shardings: Any,
    *,
    fall_back: bool,
    prefix: str | None = None,
) -> tuple[CheckpointInfo, Any, list[str]] | None:
    """Load the newest complete checkpoint at ``path``; None if there is none.

    With ``fall_back``, a checkpoint that fails to load is skipped with a warning and
    the next older one is tried; otherwise its error is raised.
    """
    for checkpoint in reversed(list_checkpoints(path)):
        try:
            tree, missing = load_checkpoint(checkpoint, template, shardings, prefix=prefix)
        except CheckpointError as e:
            if not fall_back:
                raise
            logger.warning("%s; falling back to an older checkpoint", e)
            continue
        return checkpoint, tree, missing
    return None
