"""GPU topologies by name (``h100:8``, ``h100:4x8``): compile-only NVIDIA GPUs on any host.

JAX's CUDA plugin (the ``gpu-plan`` extra: ``jax-cuda12-plugin``, its PJRT library and
``nvidia-cuda-nvcc-cu12`` for ``ptxas``) makes devices of a GPU described by a
``GpuTargetConfigProto`` without a GPU being present (``jax.experimental.topologies``), and
``jit(...).lower().compile()`` on a mesh of them builds the real sm_XX program: memory per
GPU is exact. XLA has no GPU cost model without a device (``cost_analysis()`` is None) and
autotuning cannot run, so time is a roofline estimate (``plan/compile.py``), never measured.

Each GPU's target config is written here from its public spec sheet (SM count, memory,
bandwidth, L2, clock, compute capability); the names and sizes are listed in
``GPU_FORMS`` and docs/planning.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass

from loomax.errors import UserError

GiB = 1024**3
MiB = 1024**2

DEFAULT_MEMORY_FRACTION = 0.75
"""The part of a GPU's memory JAX takes by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one NVIDIA data-centre GPU (SXM parts)."""

    description: str
    sms: int
    memory_bytes: int
    """Device memory as CUDA reports it."""
    bandwidth: float
    """HBM bandwidth, bytes/s."""
    l2_bytes: int
    clock_ghz: float
    """Boost clock."""
    compute_capability: tuple[int, int]
    peak_bf16: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    nvlink: float = 900e9
    """NVLink bandwidth per GPU, bytes/s, both directions together (as NVIDIA states it)."""
    network: float = 400e9 / 8
    """What one GPU sends to another host, bytes/s: one 400 Gb/s InfiniBand NDR NIC a GPU
    (ConnectX-7, as in DGX H100/H200/B200 and HGX systems)."""
    fp32_lanes_per_sm: int = 128
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block_optin: int = 227 * 1024

    def target_config(self) -> str:
        """The ``GpuTargetConfigProto`` text that makes XLA compile for this GPU."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: {self.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.description}"
"""


# Public figures from NVIDIA's data sheets (H100 SXM5, H200 SXM, A100 SXM4 80GB, HGX B200):
#   H100:     132 SMs, 80 GB HBM3 (79.6 GiB visible), 3.35 TB/s, 50 MB L2, 1.98 GHz, sm_90, 989 TFLOP/s
#   H200:     132 SMs, 141 GB HBM3e (140.4 GiB visible), 4.8 TB/s, 50 MB L2, 1.98 GHz, sm_90, 989 TFLOP/s
#   A100-80G: 108 SMs, 80 GB HBM2e, 2.039 TB/s, 40 MB L2, 1.41 GHz, sm_80, 312 TFLOP/s
#   B200:     148 SMs, 180 GB HBM3e, 7.7 TB/s, 126 MB L2, 1.965 GHz, sm_100, 2,250 TFLOP/s
# NVLink per GPU (bidirectional, the same data sheets): H100 and H200 900 GB/s (NVLink 4),
# A100 600 GB/s (NVLink 3), B200 1.8 TB/s (NVLink 5); between hosts one 400 Gb/s NIC a GPU
# (NDR; A100 systems: 200 Gb/s HDR).
GPUS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", 132, 81559 * MiB, 3.35e12, 50 * MiB, 1.98, (9, 0), 989.4e12),
    "h200": GpuSpec("NVIDIA H200", 132, 143771 * MiB, 4.8e12, 50 * MiB, 1.98, (9, 0), 989.4e12),
    "a100-80g": GpuSpec(
        "NVIDIA A100-SXM4-80GB", 108, 80 * GiB, 2.039e12, 40 * MiB, 1.41, (8, 0), 312e12,
        fp32_lanes_per_sm=64, shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024, nvlink=600e9, network=200e9 / 8,
    ),
    "b200": GpuSpec(
        "NVIDIA B200", 148, 180 * 10**9, 7.7e12, 126 * MiB, 1.965, (10, 0), 2.25e15, nvlink=1.8e12
    ),
}  # fmt: skip

_NAME = re.compile(r"^([a-z0-9-]+):(?:(\d+)x)?(\d+)$")

GPU_FORMS = (
    f"GPU topologies: NAME:G (one host of G GPUs) or NAME:HxG (H hosts of G GPUs), NAME one "
    f"of {', '.join(GPUS)} (e.g. h100:8, h200:4x8)"
)


def is_gpu_topology(name: str) -> bool:
    """Whether ``name`` names one of the known GPUs (``h100:8``), well formed or not."""
    return name.strip().lower().split(":")[0] in GPUS


def parse_gpu_topology(name: str) -> tuple[str, int, int]:
    """``(gpu, hosts, gpus per host)`` of ``h100:4x8``; a ``UserError`` saying what is valid."""
    match = _NAME.match(name.strip().lower())
    if not match or match.group(1) not in GPUS:
        raise UserError(f"unknown GPU topology {name!r}; {GPU_FORMS}")
    gpu, hosts, per_host = match.group(1), int(match.group(2) or 1), int(match.group(3))
    if hosts < 1 or per_host < 1:
        raise UserError(f"GPU topology {name!r} needs at least one host and one GPU; {GPU_FORMS}")
    return gpu, hosts, per_host


def memory_fraction() -> float:
    """The part of each GPU's memory a run may use: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else
    JAX's default 0.75 (with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, all of it)."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if value is not None:
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be in (0, 1], got {value!r}")
        return fraction
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return 1.0
    return DEFAULT_MEMORY_FRACTION


def check_cuda_plugin() -> None:
    """Raise ``UserError`` naming the extra to install when JAX's CUDA plugin, or the
    ``ptxas`` it compiles with, is missing."""
    missing = [
        what
        for what, there in (
            ("JAX's CUDA plugin", _installed("jax_plugins.xla_cuda12")),
            ("ptxas", _installed("nvidia.cuda_nvcc") or shutil.which("ptxas") is not None),
        )
        if not there
    ]
    if missing:
        raise UserError(
            f"compiling for a GPU topology needs {' and '.join(missing)} (no GPU needed): "
            "pip install 'loomax[gpu-plan]'"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def gpu_devices(name: str) -> tuple[list, GpuSpec, int]:
    """The compile-only devices of GPU topology ``name``, its GPU, and its hosts."""
    gpu, hosts, per_host = parse_gpu_topology(name)
    check_cuda_plugin()
    from jax.experimental import topologies

    spec = GPUS[gpu]
    try:
        desc = topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            target_config=spec.target_config(),
            topology=f"1x{hosts}x{per_host}",
        )
    except Exception as e:  # noqa: BLE001 - the plugin's message is the useful part
        raise UserError(f"JAX's CUDA plugin cannot make GPU topology {name!r}: {e}") from e
    return list(desc.devices), spec, hosts
