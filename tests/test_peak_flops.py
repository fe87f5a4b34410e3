"""Peak FLOP/s: the table for accelerators, the matmul probe on CPU, the config override."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loomax.peak_flops import device_peak_flops, measure_matmul_flops, total_peak_flops


def test_cpu_peak_is_measured_once_per_process_and_plausible():
    peak = device_peak_flops(jnp.float32)
    assert 1e9 < peak < 1e13  # a CPU: between 1 GFLOP/s and 10 TFLOP/s
    assert measure_matmul_flops("float32") == peak  # cached: later runs do not probe again


def test_an_override_replaces_the_probe_and_counts_every_device():
    assert total_peak_flops(jnp.float32, 2e12) == 2e12 * jax.device_count()
