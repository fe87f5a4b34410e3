"""A compiled step's compute at its ideal speed, one device: what the estimate's range
divides by its efficiencies (``loomax.plan.estimate``).

XLA's ops by XLA's cost model (``optimal_seconds``, scaled by the loop trip counts XLA's cost
analysis leaves out, ``loomax.plan.flops``), or, where XLA has no cost model (GPUs compiled
without a GPU), a roofline: the executed matmul FLOPs at the device's peak or the bytes of the
program's arguments, results and temporaries at its HBM bandwidth; each Pallas kernel (a
custom call XLA counts as almost free) by its FLOPs at peak or its bytes at HBM bandwidth.
"""

from __future__ import annotations

from loomax.plan.flops import KernelCall, StepCount
from loomax.plan.topology import Topology


def ideal_seconds(
    compiled, topology: Topology, count: StepCount, notes: list[str] | None = None
) -> tuple[float, str] | None:
    """``(seconds, base)``: one device's compute at its ideal speed, XLA's part by its cost
    model (``base`` ``cost model``) or, without one, the roofline (``roofline``), plus the
    kernels' (``kernel_seconds``); None where neither gives a time. ``notes`` (if given)
    gets the roofline's note."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    devices = topology.num_devices
    peak = topology.peak_per_device
    bandwidth = topology.chip.hbm_bandwidth if topology.chip else None
    kernels = sum(
        k.calls / devices * kernel_seconds(k, peak, bandwidth) for k in count.kernels.values()
    )
    if not cost:
        found = _roofline(compiled, topology, count.dot_flops / devices, notes)
        return (found + kernels, "roofline") if found is not None else None
    xla_s = _xla_seconds(cost, topology, count)
    return (xla_s + kernels, "cost model") if xla_s is not None else None


def _xla_seconds(cost: dict, topology: Topology, count: StepCount) -> float | None:
    """XLA's part of a step at its ideal speed, seconds a device.

    XLA's cost analysis counts each loop body once; its ``optimal_seconds`` and bytes are
    scaled by (matmul FLOPs XLA executes) / (FLOPs XLA counted), and XLA's part is at least
    the roofline of those FLOPs at the chip's peak and those bytes at its HBM bandwidth (None
    without any of them).
    """
    devices = topology.num_devices
    per_device = count.dot_flops / devices
    counted = float(cost.get("flops", 0.0) or 0.0)
    scale = max(1.0, per_device / counted) if counted > 0 else 1.0
    optimal = float(cost.get("optimal_seconds", -1.0) or -1.0)
    peak = topology.peak_per_device
    estimates = [optimal * scale] if optimal > 0 else []
    if peak:
        estimates.append(per_device / peak)
    bandwidth = topology.chip.hbm_bandwidth if topology.chip else None
    if bandwidth and cost.get("bytes accessed"):
        estimates.append(float(cost["bytes accessed"]) * scale / bandwidth)
    return max(estimates) if estimates else None


def kernel_seconds(kernel: KernelCall, peak: float | None, bandwidth: float | None) -> float:
    """One call's ideal time: its FLOPs at ``peak`` or its bytes at HBM ``bandwidth``,
    whichever is longer (the estimate's efficiency applies to it as to XLA's ops)."""
    compute = kernel.flops / peak if peak else 0.0
    return max(compute, kernel.bytes / bandwidth if bandwidth else 0.0)


def _roofline(compiled, topology: Topology, flops: float, notes: list[str] | None) -> float | None:
    """Ideal seconds without a cost model, the longer of ``flops`` (this device's executed
    matmul FLOPs) at its peak and, at its HBM bandwidth, the bytes it must move at least:
    every argument read and every result and temporary buffer written once."""
    peak = topology.peak_per_device
    bandwidth = topology.chip.hbm_bandwidth if topology.chip else None
    stats = compiled.memory_analysis()
    moved = 0
    if stats is not None:
        moved = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    times = {
        "matmul FLOPs at peak": flops / peak if peak else 0.0,
        "bytes at HBM bandwidth": moved / bandwidth if bandwidth else 0.0,
    }
    bound = max(times, key=times.get)
    if times[bound] <= 0:
        return None
    if notes is not None:
        notes.append(
            f"XLA has no cost model for compile-only {_chip(topology)} devices: the ideal "
            f"compute time is a roofline, bound by {bound}"
        )
    return times[bound]


def _chip(topology: Topology) -> str:
    return topology.chip.name if topology.chip else str(topology.devices[0].device_kind)
