"""Peak FLOP/s of the devices: a table for accelerators, a matmul probe for CPUs."""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak per chip (fp32 is taken as half where the chip has no faster fp32 path).
_ACCELERATOR_PEAK_BF16 = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "a10": 125e12,
}


def device_peak_flops(dtype=jnp.float32, device: jax.Device | None = None) -> float | None:
    """Peak FLOP/s of one device for matmuls in ``dtype``; None if unknown.

    Accelerators come from a table of published dense peaks; on CPU the peak is
    measured once per process by ``measure_matmul_flops``.
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measure_matmul_flops(jnp.dtype(dtype).name)
    kind = device.device_kind.lower()
    for name, peak in _ACCELERATOR_PEAK_BF16.items():
        if name in kind:
            return peak if jnp.dtype(dtype).itemsize <= 2 else peak / 2
    return None


def total_peak_flops(dtype=jnp.float32, per_device_override: float | None = None) -> float | None:
    """Peak FLOP/s of all devices together: ``per_device_override`` or ``device_peak_flops``."""
    peak = per_device_override or device_peak_flops(dtype)
    return peak * jax.device_count() if peak else None


@functools.cache
def measure_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 9) -> float:
    """The median FLOP/s of a jitted ``size``-cubed matmul in ``dtype`` on the default device.

    The median, like the step time it is compared with, not the best run: machine noise
    then moves both sides of an MFU ratio alike. 1024 is already large enough to reach a
    CPU's matmul peak (the same GFLOP/s as 2048, within run-to-run noise, on the 2-core
    Sapphire Rapids machines), and costs every run ~0.4 CPU-seconds instead of ~3.
    """
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)
