"""Memory monitor: device memory in use and at peak (GPU/TPU), host RSS, on every process;
device memory profiles at chosen steps and when the run runs out of memory.

Device values are the largest over this process's devices; with several processes the
logged value is the largest over all of them (one small all-gather), and ``per_process``
adds each process's own as ``memory/process_<i>/...``. A profile is
``jax.profiler.save_device_memory_profile`` (pprof: ``pprof -http : FILE``), one per
process, in ``<run_dir>/memory/``.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

_DEVICE_STATS = {
    "bytes_in_use": "memory/device_bytes_in_use",
    "peak_bytes_in_use": "memory/device_peak_bytes",
    "bytes_limit": "memory/device_bytes_limit",
}
_OOM_MARKS = ("resource_exhausted", "out of memory")


def memory_metrics() -> dict[str, float]:
    """``memory/*`` values of this process: the largest over its devices' stats, and host RSS."""
    out: dict[str, float] = {}
    for device in jax.local_devices():
        stats = device.memory_stats() or {}  # None on CPU
        for stat, key in _DEVICE_STATS.items():
            if stat in stats:
                out[key] = max(out.get(key, 0.0), float(stats[stat]))
    try:
        with open("/proc/self/statm") as f:
            out["memory/host_rss_bytes"] = float(
                int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            )
    except OSError:
        pass
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    out["memory/host_peak_rss_bytes"] = float(peak_kb * 1024)
    return out


def all_processes(values: dict[str, float], *, per_process: bool) -> dict[str, float]:
    """The largest of each value over every process (a collective: all must call it alike)."""
    if jax.process_count() == 1 and not per_process:
        return values
    keys = sorted(values)
    rows = np.asarray(multihost_utils.process_allgather(np.asarray([values[k] for k in keys])))
    rows = rows.reshape(jax.process_count(), len(keys))
    out = {k: float(v) for k, v in zip(keys, rows.max(axis=0), strict=True)}
    if per_process:
        for i, row in enumerate(rows):
            out.update(
                {
                    k.replace("memory/", f"memory/process_{i}/", 1): float(v)
                    for k, v in zip(keys, row, strict=True)
                }
            )
    return out


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure of the device (XLA's RESOURCE_EXHAUSTED)."""
    text = str(error).lower()
    return any(mark in text for mark in _OOM_MARKS)


@hook_type("memory")
class MemoryMonitorHook(Hook):
    """Logs ``memory/*`` every ``every`` steps; writes device memory profiles when asked."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Device memory in use and peak (GPU/TPU stats), host RSS, over every process; memory profiles."""

        every: int = 10
        """Log every this many steps."""
        per_process: bool = False
        """Also log each process's values as memory/process_<i>/... (one all-gather)."""
        profile_steps: list[int] = field(default_factory=list)
        """Steps after which a device memory profile is written to <run_dir>/memory/."""
        profile_on_oom: bool = True
        """Write a device memory profile when the run fails for want of device memory."""

        def __post_init__(self):
            self.check_positive("every")
            self.check(all(s >= 0 for s in self.profile_steps), "profile_steps must be >= 0")

    config: Config
    sees_every_step = True  # profile steps need not fall on the logging cadence

    def __init__(
        self, config: Config | None = None, /, *, run_dir: str | Path | None = None, **settings: Any
    ):
        super().__init__(config, **settings)
        self.directory = Path(run_dir or ".") / "memory"
        self.profiles: list[Path] = []
        """The memory profiles written by this process."""

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir)

    def on_step(self, info: StepInfo) -> None:
        if info.step % self.config.every == 0:
            info.log(all_processes(memory_metrics(), per_process=self.config.per_process))
        if info.step in self.config.profile_steps:
            jax.block_until_ready(info.metrics)  # the step's own buffers are in use
            self.save_profile(f"step-{info.step}")

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        if self.config.profile_on_oom and is_out_of_memory(error):
            path = self.save_profile(f"oom-step-{info.step}")
            logger.error("out of device memory at step %d: memory profile in %s", info.step, path)

    def save_profile(self, name: str) -> Path:
        """Write this process's device memory profile as ``<name>.process-<i>.prof``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}.process-{jax.process_index()}.prof"
        jax.profiler.save_device_memory_profile(str(path))
        self.profiles.append(path)
        return path
