"""Memory monitor: device memory in use and at peak (GPU/TPU), host RSS (always)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import jax

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo


def memory_metrics() -> dict[str, float]:
    """``memory/*`` values of this process: its first local device's stats, and host RSS."""
    out: dict[str, float] = {}
    stats = jax.local_devices()[0].memory_stats() or {}  # None on CPU
    if "bytes_in_use" in stats:
        out["memory/device_bytes_in_use"] = float(stats["bytes_in_use"])
    if "peak_bytes_in_use" in stats:
        out["memory/device_peak_bytes"] = float(stats["peak_bytes_in_use"])
    if "bytes_limit" in stats:
        out["memory/device_bytes_limit"] = float(stats["bytes_limit"])
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


@hook_type("memory")
class MemoryMonitorHook(Hook):
    """Logs ``memory/*`` every ``every`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Device memory in use and peak (GPU/TPU stats), host RSS."""

        every: int = 10
        """Log every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config

    def on_step(self, info: StepInfo) -> None:
        info.log(memory_metrics())
