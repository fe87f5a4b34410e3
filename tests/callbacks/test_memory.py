"""Memory monitor: host RSS (and device stats where the backend has them) every N steps."""

from __future__ import annotations

import jax
import numpy as np

from loomax.callbacks import MemoryMonitorHook
from loomax.callbacks.memory import memory_metrics
from loomax.train import StepInfo


def test_host_rss_follows_what_the_process_holds():
    before = memory_metrics()
    block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
    held = memory_metrics()
    assert held["memory/host_rss_bytes"] - before["memory/host_rss_bytes"] > 200 * 2**20
    assert held["memory/host_peak_rss_bytes"] >= held["memory/host_rss_bytes"] - 2**20
    del block
    after = memory_metrics()
    assert held["memory/host_rss_bytes"] - after["memory/host_rss_bytes"] > 200 * 2**20
    assert after["memory/host_peak_rss_bytes"] >= held["memory/host_rss_bytes"] - 2**20


def test_the_hook_logs_the_metrics_with_the_step():
    info = StepInfo(10, None, {})
    MemoryMonitorHook(every=10).on_step(info)
    assert set(info.record) >= {"memory/host_rss_bytes", "memory/host_peak_rss_bytes"}
    assert info.record["memory/host_rss_bytes"] > 1e6
    on_cpu = jax.default_backend() == "cpu"  # CPU devices have no memory stats; GPUs do
    assert ("memory/device_bytes_in_use" in info.record) is not on_cpu
