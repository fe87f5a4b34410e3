"""Multi-process JAX (``trainer.distributed``): start JAX's own distributed runtime.

Explicit settings (``coordinator_address`` and friends) win, then the ``LOOMAX_*`` variables
``loomax launch`` sets (``LOOMAX_COORDINATOR_ADDRESS``, ``LOOMAX_NUM_PROCESSES``,
``LOOMAX_PROCESS_ID``, ``LOOMAX_LOCAL_DEVICE_IDS``); otherwise JAX's auto-detection is used
where it knows the cluster (SLURM, TPU pods, MPI); on a plain machine nothing is started
and the run is single-process. On CPU, collectives go through gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import jax

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
                raise ValueError(f"environment variable {name}={value!r} is malformed: {e}") from e

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

    Its key-value store and barriers work off the main thread and need no devices.
    """
    if jax.process_count() == 1:
        return None
    from jax._src.distributed import global_state

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
    try:
        from jax._src import distributed as _dist

        return _dist.global_state.client is not None
    except (ImportError, AttributeError):
        return False


def _platform_is_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
    return platforms.split(",")[0] == "cpu" if platforms else not _has_accelerator_plugin()


def _has_accelerator_plugin() -> bool:
    import importlib.util

    return any(
        importlib.util.find_spec(m) is not None
        for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")
    )


# ---------------------------------------------------------------------- Ray
# Data preprocessing (the token cache) runs as Ray tasks: on a cluster named by `address`,
# or on a local one started here. Ray is imported only when used.


@dataclass(frozen=True)
class RayConfig:
    """Where data preprocessing runs: a Ray cluster to join, or a local one to start."""

    address: str | None = None
    """Ray cluster to join (`host:port` of its head, `ray://host:port` or `auto`); null = RAY_ADDRESS if set, else a local cluster."""
    auto_start_cluster: bool = True
    """Start a local Ray cluster when there is no address to join; false = fail instead."""
    num_cpus: int | None = None
    """CPUs of a local cluster started here; null = all cores. Unused when joining a cluster."""
    connect_timeout_s: float = 10.0
    """Seconds to wait for the cluster at `address` to answer before failing."""

    def __post_init__(self):
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"ray.num_cpus must be >= 1 or null, got {self.num_cpus}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"ray.connect_timeout_s must be > 0, got {self.connect_timeout_s}")


def init_ray(config: RayConfig) -> bool:
    """Join or start Ray as ``config`` says, unless Ray is already initialized.

    Returns whether this call initialized Ray (so the caller should shut it down). Raises
    ``ConnectionError`` naming the address if the cluster there does not answer, and
    ``RuntimeError`` if there is nothing to join and ``auto_start_cluster`` is false.
    """
    import ray

    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        if not config.auto_start_cluster:
            raise RuntimeError(
                "no Ray cluster to join: set ray.address (or RAY_ADDRESS), or set "
                "ray.auto_start_cluster: true to start a local one"
            )
        ray.init(
            address="local",
            num_cpus=config.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
        )
        return True
    _check_reachable(address, config.connect_timeout_s)
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise ConnectionError(f"cannot join the Ray cluster at {address!r}: {e}") from e
    return True


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[None]:
    """Ray joined or started as ``config`` says; shut down at exit only if started here."""
    started = init_ray(config)
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


def _check_reachable(address: str, timeout: float) -> None:
    """Raise ``ConnectionError`` unless ``host:port`` of ``address`` accepts a TCP connection.

    Ray itself waits minutes on an address nobody listens at; this fails in seconds.
    ``auto`` (any cluster running on this machine) is left to Ray.
    """
    if address == "auto":
        return
    host_port = address.removeprefix("ray://")
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        if address.startswith("ray://"):
            host, port = host_port, "10001"
        else:
            raise ValueError(
                f"ray.address must be host:port, ray://host[:port] or auto, got {address!r}"
            )
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): {e}"
        ) from e


# ------------------------------------------------------------- Ray on a pod
# On a pod (processes on several hosts) with no cluster to join, process 0 starts a Ray
# head and the processes of the other hosts join it, so that preprocessing uses every
# host's CPUs. Processes that share a host with the head, or with a process that already
# joined, add nothing: one Ray node per host.

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
    saved_env = {k: os.environ.get(k) for k in _RAY_AUTH_ENV}
    try:
        if role == "head":
            port = _free_port()
            address = f"{_host_ip()}:{port}"
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
            _stop_group(started)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ray_start(args: list[str], config: RayConfig) -> subprocess.Popen:
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
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}")
        try:
            _check_reachable(address, 1.0)
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the Ray processes started here, then SIGKILL to whatever is left of them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5 if sig == signal.SIGTERM else 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _host_ip() -> str:
    """This host's address as the other hosts reach it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
