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

    def resume_from(self, step: int) -> None:
        """The run resumed from its checkpoint at ``step``: what an interrupted attempt
        recorded after it is superseded by what comes next, so each step is recorded once.

        Called once, after the checkpoint is restored and before the first ``log`` of the
        resumed run (the tracker may already have been created).
        """

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
        """Raise a ``UserError`` now if ``init`` would fail for want of something the user
        must supply: a package that is not installed (``MissingPackageError``), credentials.
        Checked before a run builds its data and compiles; must not contact a server."""
