"""Worker for tests/distributed/test_pod_ray.py: one of 2 JAX processes posing as separate hosts.

python pod_ray_worker.py PROCESS_ID PORT    # prints JSON from process 0
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["LOOMAX_RAY_HOST"] = f"host{process_id}"  # one Ray node per "host"

from loomax.distributed import (  # noqa: E402
    DistributedConfig,
    RayConfig,
    pod_ray_cluster,
    ray_session,
)
from loomax.distributed.pod_ray import ray_address_file  # noqa: E402

DistributedConfig(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
).initialize()
with pod_ray_cluster(RayConfig(num_cpus=1)) as config:
    if process_id == 0:
        import ray

        with ray_session(config):
            nodes = [n for n in ray.nodes() if n["Alive"]]
            print(
                json.dumps(
                    {
                        "address": config.address,
                        "nodes": len(nodes),
                        "cpus": ray.cluster_resources().get("CPU"),
                        "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                        "address_file": ray_address_file().read_text().strip(),
                    }
                )
            )
