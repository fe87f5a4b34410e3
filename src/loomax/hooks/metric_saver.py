"""Metric saver: the latest logged metrics as JSON files in the run directory.

Every ``every`` steps ``<run_dir>/metrics_step{step}.json``; after every logged record
``<run_dir>/metrics.json`` (so at the end it holds the final values), each replaced whole
so a reader never sees a half-written file. Only metrics matching one of the ``include``
globs are kept.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_text
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("metric_saver")
class MetricSaverHook(Hook):
    """Collects the records the tracker receives (after the other hooks' ``pre_log``).

    Files go to ``run_dir`` where ``write`` is true (process 0).
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Latest metrics to <run_dir>/metrics_step{step}.json every N steps and metrics.json."""

        every: int | None = None
        """Write metrics_step{step}.json every this many steps; null = only metrics.json."""
        include: list[str] = field(default_factory=lambda: ["*"])
        """Glob patterns of the metric names kept, e.g. [train/*, eval/*]."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config
    sees_every_step = True  # it keeps its own cadence with config.every
    priority = -200  # its pre_log runs after the one that fills in train metrics

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path,
        write: bool = True,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.run_dir = Path(run_dir)
        self.write = write
        self.latest: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir, write=context.primary)

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        kept = {
            k: _plain(v)
            for k, v in record.items()
            if any(fnmatch.fnmatch(k, p) for p in self.config.include)
        }
        self.latest.update(kept)
        self.latest["step"] = info.step
        if not self.write:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_every = self.config.every
        if save_every and info.step % save_every == 0:
            replace_text(
                self.run_dir / f"metrics_step{info.step}.json",
                json.dumps({"step": info.step, **kept}, indent=1),
            )
        replace_text(self.run_dir / "metrics.json", json.dumps(self.latest, indent=1))


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
