"""Multi-process runs: JAX's distributed runtime, and the Ray cluster that preprocesses data.

- ``jax_processes``: ``DistributedConfig`` (``trainer.distributed``) starts ``jax.distributed``;
  ``coordination_client``, ``broadcast_str`` and ``barrier`` work across the processes.
- ``ray_cluster``: ``RayConfig`` (``trainer.ray``), ``init_ray`` and ``ray_session``.
- ``pod_ray``: one Ray node per host of a pod (``pod_ray_cluster``, ``pod_ray_role``).
- ``net`` and ``process_groups``: free ports, this host's address, stopping process groups;
  shared with ``loomax.launch``, which sits above this package.

Importing this package imports neither JAX nor Ray: each name loads its module when first
asked for (``DistributedConfig`` and the collectives import JAX), so a process that only
tokenizes (a token-cache build, a Ray task) and asks for ``RayConfig`` starts without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomax.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from loomax.distributed.jax_processes import (
        COORDINATOR_ENV,
        NUM_PROCESSES_ENV,
        PROCESS_ID_ENV,
        DistributedConfig,
        barrier,
        broadcast_str,
        coordination_client,
    )
    from loomax.distributed.pod_ray import pod_ray_cluster, pod_ray_role
    from loomax.distributed.ray_cluster import RayConfig, init_ray, ray_session

_MODULES = {
    "COORDINATOR_ENV": "loomax.distributed.jax_processes",
    "NUM_PROCESSES_ENV": "loomax.distributed.jax_processes",
    "PROCESS_ID_ENV": "loomax.distributed.jax_processes",
    "DistributedConfig": "loomax.distributed.jax_processes",
    "barrier": "loomax.distributed.jax_processes",
    "broadcast_str": "loomax.distributed.jax_processes",
    "coordination_client": "loomax.distributed.jax_processes",
    "pod_ray_cluster": "loomax.distributed.pod_ray",
    "pod_ray_role": "loomax.distributed.pod_ray",
    "RayConfig": "loomax.distributed.ray_cluster",
    "init_ray": "loomax.distributed.ray_cluster",
    "ray_session": "loomax.distributed.ray_cluster",
}
"""Each public name -> the module that defines it."""

__all__ = [
    "COORDINATOR_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "DistributedConfig",
    "RayConfig",
    "barrier",
    "broadcast_str",
    "coordination_client",
    "init_ray",
    "pod_ray_cluster",
    "pod_ray_role",
    "ray_session",
]


__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
