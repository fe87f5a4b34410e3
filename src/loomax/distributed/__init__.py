"""Multi-process runs: JAX's distributed runtime, and the Ray cluster that preprocesses data.

- ``jax_processes``: ``DistributedConfig`` (``trainer.distributed``) starts ``jax.distributed``;
  ``coordination_client``, ``broadcast_str`` and ``barrier`` work across the processes.
- ``ray_cluster``: ``RayConfig`` (``trainer.ray``), ``init_ray`` and ``ray_session``.
- ``pod_ray``: one Ray node per host of a pod (``pod_ray_cluster``, ``pod_ray_role``).
- ``net`` and ``process_groups``: free ports, this host's address, stopping process groups;
  shared with ``loomax.launch``, which sits above this package.

Importing this package imports JAX but not Ray.
"""

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
