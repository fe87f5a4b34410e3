"""Trackers: where metrics go (``trainer.tracker``: one config or a list).

``jsonl``, ``noop``, ``wandb`` and ``tensorboard``; a list builds a composite.
"""

from loomax.tracking.base import Tracker, TrackerConfig
from loomax.tracking.composite import CompositeTracker, build_tracker, check_trackers
from loomax.tracking.jsonl import JsonlTracker, JsonlTrackerConfig, read_metrics
from loomax.tracking.noop import NoopTracker, NoopTrackerConfig
from loomax.tracking.optional import MissingPackageError
from loomax.tracking.tensorboard import TensorboardTracker, TensorboardTrackerConfig
from loomax.tracking.wandb import WandbCredentialsError, WandbTracker, WandbTrackerConfig

__all__ = [
    "CompositeTracker",
    "JsonlTracker",
    "JsonlTrackerConfig",
    "MissingPackageError",
    "NoopTracker",
    "NoopTrackerConfig",
    "TensorboardTracker",
    "TensorboardTrackerConfig",
    "Tracker",
    "TrackerConfig",
    "WandbCredentialsError",
    "WandbTracker",
    "WandbTrackerConfig",
    "build_tracker",
    "check_trackers",
    "read_metrics",
]
