"""A tracker that appends one JSON object per logged step to ``<run_dir>/metrics.jsonl``.

On resume from a checkpoint at step S the file is rewritten (whole, atomically) without the
records after S that the interrupted attempt wrote, so it holds each step once;
``read_metrics`` reads it back with one record per step even where a file has duplicates
(a run restarted before its first checkpoint, a file of an older version).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_text
from loomax.tracking.base import Tracker, TrackerConfig

logger = logging.getLogger(__name__)


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
        self._file = self._open()
        self._summary: dict[str, Any] = {}
        self._merge_step: int | None = None
        """The resumed step, while its record in the file may still get more values."""

    def _open(self):
        file = open(self.path, "a", encoding="utf-8")
        if file.tell() and not _ends_with_newline(self.path):
            file.write("\n")  # a line cut short by a kill stays alone, not glued to the next
        return file

    def _rewrite(self, lines: list[str]) -> None:
        """Replace the file whole (atomically) with ``lines``; appends go on after them."""
        self._file.close()
        try:
            replace_text(self.path, "".join(line + "\n" for line in lines))
        finally:
            self._file = self._open()

    def _check_open(self) -> None:
        if self._file.closed:
            raise RuntimeError(f"the jsonl tracker of {self.path} is finished")

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        self._check_open()
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        merge, self._merge_step = self._merge_step == step, None
        if merge:  # e.g. an eval at the start of the resumed run: one record for the step
            records = _records_by_step(self.path)
            records[step] = json.dumps({**json.loads(records[step]), **record})
            self._rewrite(list(records.values()))
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def resume_from(self, step: int) -> None:
        """Rewrite the file with the records up to ``step`` only (one per step, the last);
        a first ``log`` at ``step`` itself is merged into that step's record."""
        self._check_open()
        records = _records_by_step(self.path)
        kept = {s: line for s, line in records.items() if s <= step}
        self._rewrite(list(kept.values()))
        self._merge_step = step if step in kept else None
        if len(kept) < len(records):
            logger.info(
                "%s: resumed at step %d; dropped %d later record(s) of the interrupted attempt",
                self.path,
                step,
                len(records) - len(kept),
            )

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


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, one per step (the last written for a step
    that appears twice), in step order; a line a kill cut short is skipped."""
    return [json.loads(line) for _, line in sorted(_records_by_step(Path(path)).items())]


def _records_by_step(path: Path) -> dict[int, str]:
    """``step -> line`` of the file's complete records, the last one of each step, in the
    order those were written."""
    records: dict[int, str] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # empty, or cut short when the writer was killed
        records.pop(step, None)
        records[step] = line
    return records


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
