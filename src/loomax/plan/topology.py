"""Topologies by name: TPU slices (``v5p:4x4x8``), GPU hosts (``h100:4x8``, see
``loomax.plan.gpus``) or ``local``: their devices and what one device offers.

The devices of a named topology are compile-only devices made by libtpu or JAX's CUDA
plugin (``jax.experimental.topologies``): nothing runs on them, but
``jax.jit(...).lower().compile()`` on a mesh of them compiles the real TPU or GPU program,
on any host.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import jax

from loomax.errors import UserError
from loomax.jax_setup import has_tpu_chips
from loomax.plan.gpus import (
    GPU_FORMS,
    gpu_devices,
    is_gpu_topology,
    memory_fraction,
    parse_gpu_topology,
)

GiB = 1024**3


@dataclass(frozen=True)
class ChipSpec:
    """Published figures of one TPU chip."""

    name: str
    hbm_bytes: int
    """High-bandwidth memory per chip."""
    peak_bf16: float
    """Dense bf16 matmul peak, FLOP/s per chip."""
    hbm_bandwidth: float
    """HBM bandwidth, bytes/s per chip."""
    link_bandwidth: float | None = None
    """Interconnect bandwidth one chip sends at, bytes/s, all links, one direction (TPU:
    ICI; GPU: NVLink), half the published bidirectional figure."""
    cross_bandwidth: float | None = None
    """What one chip sends at to another slice (TPU: DCN) or host (GPU: InfiniBand), bytes/s."""


# Public per-chip figures from Google Cloud's TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e):
#   v4:  32 GiB HBM2, 275 bf16 TFLOP/s, 1228 GB/s
#   v5e: 16 GiB HBM2, 197 bf16 TFLOP/s,  819 GB/s
#   v5p: 95 GiB HBM2e, 459 bf16 TFLOP/s, 2765 GB/s
#   v6e: 32 GiB HBM, 918 bf16 TFLOP/s,  1640 GB/s (Trillium)
# Interchip interconnect (ICI) per chip, the same pages' "Interchip Interconnect BW" in Gbps,
# which is one direction (v5p's 4,800 Gbps is the 1,200 GB/s bidirectional its newer table
# states; v5e's 1,600 Gbps its 400 GB/s): v4 2,400 Gbps, v5e 1,600, v5p 4,800, v6e 3,584.
# Data-centre network (DCN) between slices: v5p's page states 50 Gbps a chip; v5e's 2 x 100
# Gbps NICs a host of 8 chips is 25 Gbps a chip; 50 Gbps is taken for every generation.
_DCN = 50e9 / 8
CHIPS = {
    "v4": ChipSpec("TPU v4", 32 * GiB, 275e12, 1228e9, 2400e9 / 8, _DCN),
    "v5e": ChipSpec("TPU v5e", 16 * GiB, 197e12, 819e9, 1600e9 / 8, _DCN),
    "v5p": ChipSpec("TPU v5p", 95 * GiB, 459e12, 2765e9, 4800e9 / 8, _DCN),
    "v6e": ChipSpec("TPU v6e", 32 * GiB, 918e12, 1640e9, 3584e9 / 8, _DCN),
}
_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
_ACCELERATOR = {"v4": "v4-8", "v5p": "v5p-8", "v5e": "v5litepod-4", "v6e": "v6e-4"}
_NAME = re.compile(r"^(?:(\d+)x)?(v4|v5p|v5e|v6e):(\d+(?:x\d+)*)$")

VALID_FORMS = (
    "valid forms: v4:AxBxC, v5p:AxBxC, v5e:AxB, v6e:AxB (chips along each side, e.g. v5p:4x4x8 "
    "= 128 chips, v5e:2x2 = 4 chips), optionally NxNAME for N slices (e.g. 2xv5p:4x4x4), "
    "or local (the devices of this machine); " + GPU_FORMS
)


class TopologyError(UserError, ValueError):
    """A topology name that cannot be used (the message says why and what is valid)."""


@dataclass(frozen=True)
class Topology:
    """A set of devices to compile for, and the chip they sit on (None for ``local``)."""

    name: str
    devices: list
    chip: ChipSpec | None
    devices_per_chip: int = 1
    num_slices: int = 1
    memory_fraction: float | None = None
    """The part of each device's memory a run may use (GPUs: JAX preallocates 75%)."""
    devices_per_host: int | None = None
    """GPUs a host (one NVLink domain) holds; None for TPU slices and ``local``."""

    @property
    def platform(self) -> str:
        """``tpu``, ``gpu`` or ``cpu``: the platform of the devices."""
        return str(self.devices[0].platform)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def hbm_per_device(self) -> int | None:
        """Memory a run may use on one device (a chip, or a TensorCore where a chip shows
        two; on a GPU, JAX's part of it: ``memory_fraction``)."""
        if not self.chip:
            return _local_memory()
        return int(self.chip.hbm_bytes * (self.memory_fraction or 1.0)) // self.devices_per_chip

    @property
    def link_per_device(self) -> float | None:
        """Bytes/s one device sends over the interconnect (a chip's links shared by its
        devices), None where unknown (``local``)."""
        if not self.chip or not self.chip.link_bandwidth:
            return None
        return self.chip.link_bandwidth / self.devices_per_chip

    @property
    def cross_per_device(self) -> float | None:
        """Bytes/s one device sends to another slice or host, None where there is none."""
        spans = self.num_slices > 1 or (
            self.devices_per_host is not None and self.num_devices > self.devices_per_host
        )
        if not spans or not self.chip or not self.chip.cross_bandwidth:
            return None
        return self.chip.cross_bandwidth / self.devices_per_chip

    @property
    def devices_per_domain(self) -> int:
        """Devices one fast interconnect joins: a slice's, or a GPU host's."""
        if self.devices_per_host is not None:
            return self.devices_per_host
        return self.num_devices // max(1, self.num_slices)

    @property
    def peak_per_device(self) -> float | None:
        """Dense bf16 FLOP/s of one device."""
        if self.chip:
            return self.chip.peak_bf16 / self.devices_per_chip
        from loomax.peak_flops import device_peak_flops

        return device_peak_flops("bfloat16", self.devices[0])


def parse_topology_name(name: str) -> tuple[int, str, tuple[int, ...]]:
    """``(slices, generation, chips per side)`` of a name like ``v5p:4x4x8``; raises ``TopologyError``."""
    match = _NAME.match(name.strip().lower())
    if not match:
        raise TopologyError(f"unknown topology {name!r}; {VALID_FORMS}")
    slices, generation, sides = match.groups()
    dims = tuple(int(d) for d in sides.split("x"))
    if len(dims) != _DIMS[generation] or min(dims) < 1:
        raise TopologyError(
            f"topology {name!r}: {generation} takes {_DIMS[generation]} sides; {VALID_FORMS}"
        )
    return int(slices or 1), generation, dims


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
    """While libtpu loads: keep it from probing for a TPU VM on a host that has none.

    On a CPU host libtpu asks the cloud metadata server for this VM's accelerator type and
    worker hostnames, finds none, and prints TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES
    warnings. They are harmless for compiling (the topology comes from its name); setting
    those variables answers the probe instead. Without a chip, libtpu's one-process lock
    (/tmp/libtpu_lockfile) is not needed either. The variables are set only where unset,
    and only inside this block: elsewhere TPU_WORKER_HOSTNAMES means "a TPU pod" to loomax.
    """
    if has_tpu_chips():
        yield
        return
    added = {}
    for name, value in _QUIET_ENV.items():
        if name not in os.environ:
            os.environ[name] = added[name] = value
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


_QUIET_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def check_libtpu() -> None:
    """Raise ``TopologyError`` naming the extra to install when libtpu is missing."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise TopologyError(
            "compiling for a TPU topology needs libtpu: pip install 'loomax[tpu]' "
            "(or 'jax[tpu]'); --topology local needs nothing more"
        ) from e


def check_topology_name(name: str) -> None:
    """Raise ``TopologyError`` (saying what is valid) unless ``name`` is ``local``, a TPU
    topology or a GPU topology; compiles nothing and needs neither libtpu nor the plugin."""
    if name == "local":
        return
    if is_gpu_topology(name):
        try:
            parse_gpu_topology(name)
        except UserError as e:
            raise TopologyError(str(e)) from e
        return
    parse_topology_name(name)


def get_topology(name: str) -> Topology:
    """The devices of topology ``name`` (``local``: ``jax.devices()``); errors before any compile."""
    if name == "local":
        return Topology("local", list(jax.devices()), None)
    if is_gpu_topology(name):
        return _gpu_topology(name)
    slices, generation, dims = parse_topology_name(name)
    check_libtpu()
    from jax.experimental import topologies

    sides = ":" + "x".join(map(str, dims))
    host = [2 if d % 2 == 0 else 1 for d in (*dims, 1, 1)[:2]] + [1]
    kwargs = {"chips_per_host_bounds": host}
    if slices > 1:
        kwargs["num_slices"] = slices
    try:
        with quiet_libtpu():
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=generation + sides, **kwargs
            )
    except Exception as e:  # noqa: BLE001 - libtpu's message is the useful part
        raise TopologyError(f"libtpu cannot make topology {name!r}: {e}; {VALID_FORMS}") from e
    devices = list(desc.devices)
    chips = len({(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices})
    return Topology(name, devices, CHIPS[generation], max(1, len(devices) // chips), slices)


def _gpu_topology(name: str) -> Topology:
    """Compile-only GPUs of ``name`` (``h100:4x8``): the plugin's devices, the GPU's memory
    (of which a run may use ``memory_fraction()``), peak and bandwidth."""
    fraction = memory_fraction()
    try:
        devices, spec, hosts = gpu_devices(name)
    except UserError as e:
        raise TopologyError(str(e)) from e
    chip = ChipSpec(
        spec.description,
        spec.memory_bytes,
        spec.peak_bf16,
        spec.bandwidth,
        spec.nvlink / 2,
        spec.network,
    )
    per_host = len(devices) // max(1, hosts)
    return Topology(name, devices, chip, memory_fraction=fraction, devices_per_host=per_host)


def _local_memory() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices have none
        stats = {}
    return stats.get("bytes_limit")
