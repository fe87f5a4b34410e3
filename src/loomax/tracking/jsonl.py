"""A tracker that appends one JSON object per logged step to ``<run_dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomax.tracking.base import Tracker, TrackerConfig


@TrackerConfig.register_subclass("jsonl")
@dataclass(frozen=True)
class JsonlTrackerConfig(TrackerConfig):
    """Metrics as JSON lines in the run directory."""

    path: str | None = None
    """File to append to; null = <run_dir>/metrics.jsonl."""

    def init(self, run_dir: Path) -> Tracker:
        return JsonlTracker(Path(self.path) if self.path else Path(run_dir) / "metrics.jsonl")


class JsonlTracker(Tracker):
    """Appends ``{"step": N, ...metrics}`` lines; writes ``summary.json`` at the end."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._summary: dict[str, Any] = {}

    def _check_open(self) -> None:
        if self._file.closed:
            raise RuntimeError(f"the jsonl tracker of {self.path} is finished")

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        self._check_open()
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._check_open()
        with open(self.path.parent / "hparams.json", "w", encoding="utf-8") as f:
            json.dump(hparams, f, indent=2, default=str)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._check_open()
        self._summary.update({k: _jsonable(v) for k, v in summary.items()})
        with open(self.path.parent / "summary.json", "w", encoding="utf-8") as f:
            json.dump(self._summary, f, indent=2)

    def log_artifact(self, path: Path, *, name: str, type: str = "artifact") -> None:
        self._check_open()  # the file itself already lies in the run directory

    def finish(self) -> None:
        self._file.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
