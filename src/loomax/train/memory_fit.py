"""Will the step fit? The compiled step's memory against the host's or the devices', before
the first step (``trainer.check_memory``).

The need is XLA's own account of the compiled program (``memory_analysis``: its arguments
and outputs less the donated state they share, its temporaries and code), per device, as
``loomax compile`` reads it. On CPUs every device of a process shares the host's RAM, so the
need of a process is that of its devices together, against the RAM available now (the
lesser of ``MemAvailable`` and the cgroup's limit). On GPUs and TPUs each device's need is
set against what that device has left. A step that will not fit ends the run in one line
naming both figures and the settings that change them, instead of the kernel's OOM killer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from loomax.errors import UserError

GIB = 2**30


class StepMemoryError(UserError, MemoryError):
    """The compiled train step needs more memory than the host or a device has."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one device's share of the compiled step needs, in bytes."""

    state: int
    """Its inputs and outputs (the state, donated and updated in place, and the batch)."""
    temporaries: int
    """Activations, gradients and other buffers live during the step, and the program's code."""

    @property
    def total(self) -> int:
        return self.state + self.temporaries


def step_memory(compiled) -> StepMemory | None:
    """One device's need from ``compiled.memory_analysis()``; None when the backend gives none."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if stats is None:
        return None
    state = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    temporaries = stats.temp_size_in_bytes + stats.generated_code_size_in_bytes
    return StepMemory(state, temporaries)


def host_available_bytes() -> int | None:
    """RAM this process can still take: ``MemAvailable``, capped by a cgroup (v2 or v1) limit."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, int(limit) - usage)
    return available


def device_available_bytes(device: jax.Device) -> int | None:
    """Memory ``device`` has left (its limit less what is in use); None when it does not say."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else limit - stats.get("bytes_in_use", 0)


KNOBS = (
    "make the model smaller (model.hidden_dim, model.num_layers; a mixture of experts: "
    "model.moe.num_experts, model.moe.expert_intermediate_dim), the batch smaller "
    "(trainer.train_batch_size, or microbatches with trainer.per_device_parallelism), keep "
    "fewer activations (model.gradient_checkpointing true), or shard over more devices "
    "(trainer.mesh); trainer.check_memory false tries anyway"
)


def check_step_fits_everywhere(compiled, devices: Sequence[jax.Device]) -> StepMemory | None:
    """``check_step_fits`` on every process, agreed: when the step does not fit one process,
    every process raises (none is left waiting for the others at the first step)."""
    try:
        need, refused = check_step_fits(compiled, devices), None
    except StepMemoryError as error:
        need, refused = None, error
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.process_allgather(np.int32(refused is not None)))
        if refused is None and flags.any():
            refused = StepMemoryError(
                f"the train step will not fit in the memory of process {int(flags.argmax())} "
                "(its own error says by how much); stopping every process"
            )
    if refused is not None:
        raise refused
    return need


def check_step_fits(compiled, devices: Sequence[jax.Device]) -> StepMemory | None:
    """Raise ``StepMemoryError`` when the compiled step over ``devices`` (this process's share
    of the mesh) needs more memory than there is; returns the need (None when unknown)."""
    need = step_memory(compiled)
    if need is None or not devices:
        return need
    platform = devices[0].platform
    if platform == "cpu":
        have = host_available_bytes()
        n = len(devices)
        total = need.total * n
        where = f"{n} CPU device{'s' * (n > 1)} of this process" if n > 1 else "this process"
        if have is not None and total > have:
            raise StepMemoryError(
                f"the train step will not fit in memory: it needs {total / GIB:.2f} GiB for "
                f"{where} (state and batch {need.state * n / GIB:.2f} GiB, activations and "
                f"temporaries {need.temporaries * n / GIB:.2f} GiB, by XLA's memory analysis) but "
                f"this host has {have / GIB:.2f} GiB of RAM available; {KNOBS}"
            )
        return need
    for device in devices:
        have = device_available_bytes(device)
        if have is not None and need.total > have:
            raise StepMemoryError(
                f"the train step will not fit in memory: it needs {need.total / GIB:.2f} GiB per "
                f"device (state and batch {need.state / GIB:.2f} GiB, activations and temporaries "
                f"{need.temporaries / GIB:.2f} GiB, by XLA's memory analysis) but {device} has "
                f"{have / GIB:.2f} GiB free; {KNOBS}"
            )
    return need
