"""Checkpoints: pytrees in tensorstore (``serialize``) and the save/load policies (``checkpointer``)."""

from loomax.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointInfo,
    CheckpointSaveError,
    KeepPolicy,
    list_checkpoints,
    load_checkpoint,
    load_latest,
)
from loomax.checkpoint.serialize import CheckpointError, read_tree, snapshot, write_snapshot

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSaveError",
    "Checkpointer",
    "CheckpointerConfig",
    "KeepPolicy",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "read_tree",
    "snapshot",
    "write_snapshot",
]
