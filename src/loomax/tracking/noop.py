"""A tracker that records nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomax.tracking.base import Tracker, TrackerConfig


@TrackerConfig.register_subclass("noop")
@dataclass(frozen=True)
class NoopTrackerConfig(TrackerConfig):
    """Discard all metrics."""

    def init(self, run_dir: Path) -> Tracker:
        return NoopTracker()


class NoopTracker(Tracker):
    """Discards everything."""

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        pass
