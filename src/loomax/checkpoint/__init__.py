"""Checkpoints: pytrees in tensorstore (``serialize``), when they are saved and deleted
(``policy``), finding and reading them (``discovery``), and saving them (``checkpointer``)."""

from loomax.checkpoint.checkpointer import Checkpointer, CheckpointSaveError
from loomax.checkpoint.discovery import (
    CheckpointInfo,
    list_checkpoints,
    load_checkpoint,
    load_latest,
)
from loomax.checkpoint.policy import CheckpointerConfig, KeepPolicy
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
