"""TensorBoard event files under ``logdir``, written with tensorboard's own writer (no TensorFlow).

A resumed run marks its restart so that TensorBoard drops what the interrupted attempt
logged after the checkpoint.
"""

from __future__ import annotations

import json
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomax.tracking.base import Tracker, TrackerConfig
from loomax.tracking.optional import check_installed, require


@TrackerConfig.register_subclass("tensorboard")
@dataclass(frozen=True)
class TensorboardTrackerConfig(TrackerConfig):
    """Scalars (and the config as text) in TensorBoard event files."""

    logdir: str | None = None
    """Directory of the event files; null = <run_dir>/tensorboard."""
    flush_secs: float = 10.0
    """Seconds between flushes of the event file to disk."""

    def __post_init__(self):
        if not self.flush_secs > 0:
            raise ValueError(f"trainer.tracker.flush_secs must be > 0, got {self.flush_secs}")

    def check_available(self) -> None:
        check_installed("tensorboard", extra="tensorboard", tracker="tensorboard")

    def init(self, run_dir: Path) -> Tracker:
        return TensorboardTracker(
            Path(self.logdir) if self.logdir else Path(run_dir) / "tensorboard", self.flush_secs
        )


class TensorboardTracker(Tracker):
    """Numeric metrics become scalars; config, summary and artifacts become text entries."""

    def __init__(self, logdir: Path, flush_secs: float = 10.0):
        writer = require(
            "tensorboard.summary.writer.event_file_writer",
            extra="tensorboard",
            tracker="tensorboard",
        )
        self._event = require(
            "tensorboard.compat.proto.event_pb2", extra="tensorboard", tracker="tensorboard"
        )
        self._summary = require(
            "tensorboard.compat.proto.summary_pb2", extra="tensorboard", tracker="tensorboard"
        )
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = writer.EventFileWriter(str(logdir), flush_secs=flush_secs)
        self._last_step = 0

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        Value = self._summary.Summary.Value
        values = [
            Value(tag=k, simple_value=float(v))
            for k, v in ((k, _scalar(v)) for k, v in metrics.items())
            if isinstance(v, numbers.Real)
        ]
        self._last_step = max(self._last_step, step)
        if values:
            self._write(self._summary.Summary(value=values), step)

    def resume_from(self, step: int) -> None:
        """Write a session start at ``step + 1``: TensorBoard's readers drop the events read
        before it (the interrupted attempt's files) at that step and after, as tensorboard's
        own writers do for ``purge_step``."""
        start = self._event.SessionLog(status=self._event.SessionLog.START)
        self._writer.add_event(
            self._event.Event(wall_time=time.time(), step=step + 1, session_log=start)
        )
        self._last_step = step

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._text("config", _json_block(hparams), 0)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._text(
            "summary", _json_block({k: _scalar(v) for k, v in summary.items()}), self._last_step
        )

    def log_artifact(self, path: Path, *, name: str, type: str = "artifact") -> None:
        self._text(f"artifacts/{name}", f"{type}: `{path}`", self._last_step)

    def finish(self) -> None:
        self._writer.close()

    def _text(self, tag: str, text: str, step: int) -> None:
        summary_pb2 = self._summary
        tensor_pb2 = require(
            "tensorboard.compat.proto.tensor_pb2", extra="tensorboard", tracker="tensorboard"
        )
        shape_pb2 = require(
            "tensorboard.compat.proto.tensor_shape_pb2", extra="tensorboard", tracker="tensorboard"
        )
        tensor = tensor_pb2.TensorProto(
            dtype=7,  # DT_STRING
            string_val=[text.encode("utf-8")],
            tensor_shape=shape_pb2.TensorShapeProto(dim=[shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        )
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)
        self._write(summary_pb2.Summary(value=[value]), step)

    def _write(self, summary, step: int) -> None:
        self._writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=summary))


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    return value


def _json_block(values: dict[str, Any]) -> str:
    return "```\n" + json.dumps(values, indent=2, default=str) + "\n```"
