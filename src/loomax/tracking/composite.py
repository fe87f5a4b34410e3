"""Several trackers behind one; also builds the tracker(s) named by ``trainer.tracker``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from loomax.jax_setup import process_index_before_backend
from loomax.tracking.base import Tracker, TrackerConfig
from loomax.tracking.noop import NoopTracker


class CompositeTracker(Tracker):
    """Forwards every call to each of ``trackers`` in order."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step=step)

    def resume_from(self, step: int) -> None:
        for t in self.trackers:
            t.resume_from(step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_hyperparameters(hparams)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_summary(summary)

    def log_artifact(self, path: Path, *, name: str, type: str = "artifact") -> None:
        for t in self.trackers:
            t.log_artifact(path, name=name, type=type)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()


def check_trackers(config: TrackerConfig | Sequence[TrackerConfig]) -> None:
    """Raise a ``UserError`` now if a tracker ``build_tracker`` would make on this process
    lacks its package or credentials (``TrackerConfig.check_available``), before any
    expensive work."""
    if process_index_before_backend() != 0:  # no JAX threads before Ray forks
        return
    for c in [config] if isinstance(config, TrackerConfig) else config:
        c.check_available()


def build_tracker(config: TrackerConfig | Sequence[TrackerConfig], run_dir: Path) -> Tracker:
    """The tracker for ``config`` (one or a list); a no-op on every process but 0."""
    if jax.process_index() != 0:
        return NoopTracker()
    if isinstance(config, TrackerConfig):
        return config.init(run_dir)
    return CompositeTracker([c.init(run_dir) for c in config])
