"""Metric saver: the latest logged metrics as JSON files in the run directory.

Every ``every`` steps ``<run_dir>/metrics_step{step}.json``; after every logged record
``<run_dir>/metrics.json`` (so at the end it holds the final values). Only metrics
matching one of the ``include`` globs are kept.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo


class MetricSaverHook(Hook):
    """Collects the records the tracker receives (after the other hooks' ``pre_log``)."""

    priority = -200  # its pre_log runs after the one that fills in train metrics

    def __init__(
        self,
        run_dir: Path,
        *,
        every: int | None = None,
        include: list[str] | None = None,
        write: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.save_every = every
        self.include = include or ["*"]
        self.write = write
        self.latest: dict[str, Any] = {}

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        kept = {
            k: _plain(v)
            for k, v in record.items()
            if any(fnmatch.fnmatch(k, p) for p in self.include)
        }
        self.latest.update(kept)
        self.latest["step"] = info.step
        if not self.write:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.save_every and info.step % self.save_every == 0:
            (self.run_dir / f"metrics_step{info.step}.json").write_text(
                json.dumps({"step": info.step, **kept}, indent=1)
            )
        (self.run_dir / "metrics.json").write_text(json.dumps(self.latest, indent=1))


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@HookConfig.register_subclass("metric_saver")
@dataclass(frozen=True)
class MetricSaverConfig(HookConfig):
    """Latest metrics to <run_dir>/metrics_step{step}.json every N steps and metrics.json."""

    every: int | None = None
    """Write metrics_step{step}.json every this many steps; null = only metrics.json."""
    include: list[str] = field(default_factory=lambda: ["*"])
    """Glob patterns of the metric names kept, e.g. [train/*, eval/*]."""

    def __post_init__(self):
        check_positive(self, "every")

    def build(self, context: HookContext) -> Hook:
        return MetricSaverHook(
            context.run_dir,
            every=self.every,
            include=list(self.include),
            write=context.primary,
        )
