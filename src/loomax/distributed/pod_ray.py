"""Ray spread over a pod's hosts: process 0 starts a head, the other hosts join it.

On a pod (processes on several hosts) with no cluster to join, process 0 starts a Ray head
and the first process of every other host joins it, so that preprocessing uses every host's
CPUs. Processes that share a host with the head, or with a process that already joined, add
nothing: one Ray node per host. The nodes are ``ray start --block`` subprocesses in process
groups of their own, token-protected, and stopped (helpers and all) when the run is done.
The processes agree on roles and the head's address over JAX's coordination service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from loomax.distributed.jax_processes import barrier, broadcast_str, coordination_client
from loomax.distributed.net import free_port, host_ip
from loomax.distributed.process_groups import stop_groups
from loomax.distributed.ray_cluster import RayConfig, check_reachable

logger = logging.getLogger(__name__)

_RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")

HOST_ENV = "LOOMAX_RAY_HOST"
"""Overrides this process's host name for the one-node-per-host rule (tests, odd networks)."""


def pod_ray_role(config: RayConfig, hosts: list[str], process_index: int) -> str:
    """What process ``process_index`` of a run on ``hosts`` (one per process) does for Ray.

    ``"none"``: nothing (one host, a cluster to join, or ``auto_start_cluster: false``);
    ``"head"``: process 0 starts the head; ``"join"``: the first process of another host
    joins it; ``"idle"``: a process whose host already has a Ray node.
    """
    if config.address or os.environ.get("RAY_ADDRESS") or not config.auto_start_cluster:
        return "none"
    if len(set(hosts)) <= 1:
        return "none"
    if process_index == 0:
        return "head"
    first_on_host = hosts.index(hosts[process_index]) == process_index
    return "join" if first_on_host and hosts[process_index] != hosts[0] else "idle"


@contextlib.contextmanager
def pod_ray_cluster(config: RayConfig) -> Iterator[RayConfig]:
    """Ray spread over the pod's hosts for the block; yields the ``RayConfig`` to use.

    Process 0 gets ``address`` = the head it started; other processes get ``config``
    unchanged. With one process or one host nothing is started (``init_ray`` then starts
    a local Ray on process 0 as usual). The Ray processes started here are stopped at exit.
    """
    client = coordination_client()
    if client is None:
        yield config
        return
    me, count = jax.process_index(), jax.process_count()
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    client.key_value_set(f"loomax/ray/host/{me}", host)
    hosts = [client.blocking_key_value_get(f"loomax/ray/host/{i}", 600_000) for i in range(count)]
    role = pod_ray_role(config, hosts, me)
    if role == "none":
        yield config
        return
    started: subprocess.Popen | None = None
    address: str | None = None
    saved_env = {k: os.environ.get(k) for k in _RAY_AUTH_ENV}
    try:
        if role == "head":
            port = free_port("")  # the head listens on every interface
            address = f"{host_ip()}:{port}"
            auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
            os.environ.update(auth)  # for `ray start` and this process's ray.init
            started = _ray_start(["--head", f"--port={port}", "--include-dashboard=false"], config)
            _wait_reachable(address, started, timeout=120.0)
            broadcast_str("ray_head", json.dumps({"address": address, **auth}))
            logger.info("Ray head for the pod at %s", address)
            barrier("loomax_ray_joined")
            yield dataclasses.replace(config, address=address)
            barrier("loomax_ray_done", timeout=24 * 3600)  # the joined nodes served until now
        else:
            head = json.loads(broadcast_str("ray_head", ""))
            address = head.pop("address")
            if role == "join":
                os.environ.update(head)
                started = _ray_start([f"--address={address}"], config)
                logger.info("joined the pod's Ray head at %s", address)
            barrier("loomax_ray_joined")
            yield config
            barrier("loomax_ray_done", timeout=24 * 3600)
    finally:
        if started is not None:
            stop_groups([started])
        if role == "head" and address is not None:
            forget_head_address(address)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ray_address_file() -> Path:
    """Where ``ray start --head`` records its address for later plain ``ray.init()`` calls
    on this host (Ray's temp dir: ``RAY_TMPDIR``, else ``TMPDIR`` on Linux, else /tmp)."""
    if "RAY_TMPDIR" in os.environ:
        root = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        root = os.environ["TMPDIR"]
    else:
        root = "/tmp"
    return Path(root) / "ray" / "ray_current_cluster"


def forget_head_address(address: str) -> None:
    """Remove the address file of the head stopped here, as ``ray stop`` would: left
    behind, it sends this host's next ``ray.init()`` to a cluster that is gone. A file
    naming another cluster is left alone."""
    path = ray_address_file()
    try:
        if path.read_text().strip() == address:
            path.unlink()
    except OSError:
        pass


def _ray_start(args: list[str], config: RayConfig) -> subprocess.Popen:
    """``ray start --block ARGS`` in a session of its own, returned once its node is up."""
    ray = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    argv = [ray, "start", "--block", "--disable-usage-stats", *args]
    if config.num_cpus is not None:
        argv.append(f"--num-cpus={config.num_cpus}")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tail: list[str] = []
    for line in proc.stdout:  # the node is registered with the head once this is printed
        tail = [*tail[-20:], line]
        if "Ray runtime started" in line:
            break
    else:
        proc.wait()
        raise RuntimeError(
            f"`ray start {' '.join(args)}` exited with {proc.returncode}:\n{''.join(tail)}"
        )
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc


def _wait_reachable(address: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the head ``proc`` started answers at ``address``; fail if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}")
        try:
            check_reachable(address, 1.0)
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
