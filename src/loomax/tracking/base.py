"""The tracker interface and its config registry (``trainer.tracker.type``)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import draccus


class Tracker(abc.ABC):
    """Receives metrics from process 0. Implementations must not block training for long.

    ``finish`` may be called twice; after it, every other call raises (a tracker that
    records nothing, like ``noop``, may ignore them all instead).
    """

    @abc.abstractmethod
    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        """Record ``metrics`` at ``step``."""

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        """Record the run's resolved configuration."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Record end-of-run values."""

    def log_artifact(self, path: Path, *, name: str, type: str = "artifact") -> None:
        """Record a file or directory the run wrote (``trainer.write_artifact``)."""

    def finish(self) -> None:
        """Flush and close."""


@dataclass(frozen=True)
class TrackerConfig(draccus.ChoiceRegistry, abc.ABC):
    """Base of tracker configs; ``type`` picks the implementation."""

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "jsonl"

    @abc.abstractmethod
    def init(self, run_dir: Path) -> Tracker:
        """Create the tracker for a run whose directory is ``run_dir``."""

    def check_available(self) -> None:
        """Raise ``MissingPackageError`` now if ``init`` would need a package that is not
        installed (checked before a run builds its data and compiles)."""
