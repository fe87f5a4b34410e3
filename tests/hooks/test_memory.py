"""Memory monitor: host RSS (and device stats where the backend has them) every N steps, over
every process; device memory profiles at chosen steps and on running out of memory."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from loomax.hooks import LogMetricsHook, MemoryMonitorHook
from loomax.hooks.memory import is_out_of_memory, memory_metrics
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


def test_profiles_at_chosen_steps_and_when_the_run_runs_out_of_memory(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=6)
    memory = MemoryMonitorHook(
        every=2, per_process=True, profile_steps=[2], run_dir=trainer.run_dir
    )
    trainer.add_hook(memory)
    trainer.add_hook(LogMetricsHook(every=2, tokens_per_step=64))

    @trainer.add_hook(every=3)
    def exhaust(info):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.0TiB")

    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    names = sorted(p.name for p in (trainer.run_dir / "memory").iterdir())
    assert names == ["oom-step-3.process-0.prof", "step-2.process-0.prof"]
    for path in memory.profiles:  # pprof files (gzipped protobuf)
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    (record,) = [
        r for r in map(json.loads, (trainer.run_dir / "metrics.jsonl").open()) if r["step"] == 2
    ]
    rss = record["memory/host_rss_bytes"]
    assert rss > 1e6 and record["memory/process_0/host_rss_bytes"] == rss  # one process: its own
    assert not is_out_of_memory(ValueError("bad value"))
