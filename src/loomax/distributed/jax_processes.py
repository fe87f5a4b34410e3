"""Multi-process JAX (``trainer.distributed``): start JAX's own distributed runtime.

``DistributedConfig.initialize`` joins this process to the run. Explicit settings
(``coordinator_address`` and friends) win, then the ``LOOMAX_*`` variables ``loomax launch``
sets (``LOOMAX_COORDINATOR_ADDRESS``, ``LOOMAX_NUM_PROCESSES``, ``LOOMAX_PROCESS_ID``,
``LOOMAX_LOCAL_DEVICE_IDS``); otherwise JAX's auto-detection is used where it knows the
cluster (SLURM, TPU pods, MPI); on a plain machine nothing is started and the run is
single-process. On CPU, collectives go through gloo.

Once joined, ``coordination_client`` gives JAX's coordination service (a key-value store
with barriers that needs no devices), on which ``broadcast_str`` and ``barrier`` are built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import jax

from loomax.config import ConfigError

logger = logging.getLogger(__name__)

COORDINATOR_ENV = "LOOMAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "LOOMAX_NUM_PROCESSES"
PROCESS_ID_ENV = "LOOMAX_PROCESS_ID"
LOCAL_DEVICE_IDS_ENV = "LOOMAX_LOCAL_DEVICE_IDS"

_CLUSTER_ENV = (
    "SLURM_JOB_ID",
    "TPU_WORKER_HOSTNAMES",
    "OMPI_COMM_WORLD_SIZE",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run."""

    coordinator_address: str | None = None
    """host:port of process 0's coordinator; null = auto-detect (SLURM, TPU) or single process."""
    num_processes: int | None = None
    """Total processes; null = auto-detect."""
    process_id: int | None = None
    """This process's index, 0-based; null = auto-detect."""
    local_device_ids: list[int] | None = None
    """Devices this process uses (e.g. one GPU per process); null = all visible."""
    initialize_jax_distributed: bool = True
    """Start jax.distributed when explicit settings or a known cluster are found."""

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes <= 0:
            raise ValueError(
                f"trainer.distributed.num_processes must be positive, got {self.num_processes}"
            )
        if (
            self.process_id is not None
            and self.num_processes is not None
            and not 0 <= self.process_id < self.num_processes
        ):
            raise ValueError(
                f"trainer.distributed.process_id ({self.process_id}) must be in [0, num_processes={self.num_processes})"
            )

    @property
    def explicit(self) -> bool:
        """Whether a coordinator is named, here or by ``LOOMAX_COORDINATOR_ADDRESS``."""
        return self.resolved().coordinator_address is not None

    def resolved(self) -> DistributedConfig:
        """These settings, with unset fields taken from the ``LOOMAX_*`` launch variables."""
        env = os.environ

        def from_env(name: str, parse):
            value = env.get(name)
            if not value:
                return None
            try:
                return parse(value)
            except ValueError as e:
                raise ConfigError(f"environment variable {name}={value!r} is malformed: {e}") from e

        ids = from_env(LOCAL_DEVICE_IDS_ENV, lambda v: [int(x) for x in v.split(",")])
        return dataclasses.replace(
            self,
            coordinator_address=self.coordinator_address or env.get(COORDINATOR_ENV) or None,
            num_processes=self.num_processes or from_env(NUM_PROCESSES_ENV, int),
            process_id=self.process_id
            if self.process_id is not None
            else from_env(PROCESS_ID_ENV, int),
            local_device_ids=self.local_device_ids or ids,
        )

    def initialize(self) -> None:
        """Start ``jax.distributed`` if this run is multi-process; safe to call twice."""
        if not self.initialize_jax_distributed or _already_initialized():
            return
        settings = self.resolved()
        if not settings.explicit and not any(v in os.environ for v in _CLUSTER_ENV):
            return
        if _platform_is_cpu():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=settings.local_device_ids,
        )
        logger.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def coordination_client():
    """The JAX coordination-service client of a multi-process run; None with one process.

    Its key-value store and barriers work off the main thread and need no devices. Without
    ``jax.distributed`` this asks nothing of JAX's backend, so a one-process run starts
    no JAX threads here (Ray, started later for the data, forks its daemons safely).
    """
    from jax._src.distributed import global_state  # no public API gives the client

    if global_state.client is None or jax.process_count() == 1:
        return None
    return global_state.client


def broadcast_str(name: str, value: str, timeout: float = 600.0) -> str:
    """Process 0's ``value`` on every process (``name`` must be unique per call)."""
    client = coordination_client()
    if client is None:
        return value
    key = f"loomax/broadcast/{name}"
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, int(timeout * 1000))


def barrier(name: str, timeout: float = 600.0) -> None:
    """Wait until every process reaches ``name`` (no-op with one process)."""
    client = coordination_client()
    if client is not None:
        client.wait_at_barrier(name, int(timeout * 1000))


def _already_initialized() -> bool:
    return jax.distributed.is_initialized()


def _platform_is_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
    return platforms.split(",")[0] == "cpu" if platforms else not _has_accelerator_plugin()


def _has_accelerator_plugin() -> bool:
    import importlib.util

    return any(
        importlib.util.find_spec(m) is not None
        for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")
    )
