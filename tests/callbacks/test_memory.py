"""Memory monitor: host RSS (and device stats where the backend has them) every N steps."""

from __future__ import annotations

from loomax.callbacks import MemoryMonitorHook
from loomax.callbacks.memory import memory_metrics
from loomax.train import StepInfo


def test_memory_metrics_are_logged():
    values = memory_metrics()
    assert values["memory/host_rss_bytes"] > 1e6
    assert values["memory/host_peak_rss_bytes"] >= values["memory/host_rss_bytes"] * 0.5
    info = StepInfo(10, None, {})
    MemoryMonitorHook(every=10).on_step(info)
    assert "memory/host_rss_bytes" in info.record
