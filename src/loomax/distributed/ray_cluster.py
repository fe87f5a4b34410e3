"""Ray for data preprocessing (``trainer.ray``): join a cluster, or start a local one.

The token cache is built by Ray tasks, on the cluster named by ``RayConfig.address`` (or
``RAY_ADDRESS``), or on a local cluster started here. An address nobody answers at fails in
seconds (``check_reachable``) instead of Ray's minutes of waiting. Ray is imported only
inside the functions that use it, so importing this module does not import Ray. Ray's
notice that a new local cluster uses token authentication, its default, is kept off the
console. A local start forks Ray's daemons (running Python between fork and exec), so a
run starts it before JAX's backend runs threads: the checks before the data build read
the process index with ``loomax.jax_setup.process_index_before_backend``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from loomax.config import ConfigError
from loomax.distributed.net import check_tcp

_RAY_CLIENT_PORT = 10001  # the Ray client port of a ray://host address that names none
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_DEFAULT_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."


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
    ``ConfigError`` if there is nothing to join and ``auto_start_cluster`` is false.
    """
    import ray

    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        if not config.auto_start_cluster:
            raise ConfigError(
                "no Ray cluster to join: set ray.address (or RAY_ADDRESS), or set "
                "ray.auto_start_cluster: true to start a local one"
            )
        quiet_default_auth_notice()
        ray.init(
            address="local",
            num_cpus=config.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
        )
        return True
    check_reachable(address, config.connect_timeout_s)
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise ConnectionError(f"cannot join the Ray cluster at {address!r}: {e}") from e
    return True


class _DropDefaultAuthNotice(logging.Filter):
    """Drops Ray's warning that a new local cluster uses token authentication: that is its
    default and asks nothing of the user. Every other record (the warning that a cluster
    runs *without* authentication among them) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_DEFAULT_AUTH_NOTICE)


def quiet_default_auth_notice() -> None:
    """Keep Ray's default-authentication notice off the console (once per process)."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DropDefaultAuthNotice) for f in logger.filters):
        logger.addFilter(_DropDefaultAuthNotice())


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


def check_reachable(address: str, timeout: float) -> None:
    """Raise ``ConnectionError`` unless the head at Ray ``address`` accepts a TCP connection.

    ``address`` is ``host:port`` or ``ray://host[:port]`` (``ConfigError`` otherwise);
    ``auto`` (any cluster running on this machine) is left to Ray.
    """
    if address == "auto":
        return
    host_port = address.removeprefix("ray://")
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        if address.startswith("ray://"):
            host, port = host_port, str(_RAY_CLIENT_PORT)
        else:
            raise ConfigError(
                f"ray.address must be host:port, ray://host[:port] or auto, got {address!r}"
            )
    try:
        check_tcp(host, int(port), timeout)
    except OSError as e:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): {e}"
        ) from e
