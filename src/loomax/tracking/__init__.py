"""Trackers: where metrics go (``trainer.tracker``: one config or a list)."""

from loomax.tracking.base import Tracker, TrackerConfig
from loomax.tracking.composite import CompositeTracker, build_tracker
from loomax.tracking.jsonl import JsonlTracker, JsonlTrackerConfig
from loomax.tracking.noop import NoopTracker, NoopTrackerConfig

__all__ = [
    "CompositeTracker",
    "JsonlTracker",
    "JsonlTrackerConfig",
    "NoopTracker",
    "NoopTrackerConfig",
    "Tracker",
    "TrackerConfig",
    "build_tracker",
]
