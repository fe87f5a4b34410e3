"""Network helpers shared by the multi-process setup here and by ``loomax launch``.

This is the lowest layer of the two: ``loomax.launch`` imports it, it imports nothing of Loomax.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST_PORT = 20000
"""Ports below this are left alone: well-known services, and Ray's default worker ports (10002-19999)."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    """Whether a TCP server could bind ``host:port`` now (``""``: IPv4 and IPv6 wildcards)."""
    addresses = [(socket.AF_INET, host or "0.0.0.0")]
    if not host and socket.has_ipv6:
        addresses.append((socket.AF_INET6, "::"))  # a JAX coordinator binds [::]:port
    for family, address in addresses:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with probe:
            try:
                probe.bind((address, port))
            except OSError:
                return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (``""``: every interface) that nothing is bound to right now.

    Racy by nature: the probe socket is closed before this returns, so the port is only
    *likely* to be free when the caller's server (usually a child process: a JAX coordinator,
    a Ray head) binds it moments later. To keep the window small the port is drawn at random
    from below the kernel's ephemeral range: a port from ``bind(0)`` lies inside it, where
    every outgoing connection (gloo's all-reduce pairs, Ray's clients) may take it in the
    meantime. A lost race shows as that server failing with "address already in use"; pick a
    new port and start it again (``loomax launch --retries`` does so for a local launch, each
    attempt asking for a fresh port).
    """
    low, _ = ephemeral_ports()
    if low - _LOWEST_PORT >= 1000:
        draw = random.SystemRandom()
        for _ in range(100):
            port = draw.randrange(_LOWEST_PORT, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def host_ip() -> str:
    """This host's address as other hosts reach it (the interface of the default route).

    Falls back to ``127.0.0.1`` on a machine with no route out.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # a UDP "connect" sends no packet
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def check_tcp(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ``OSError`` if it does not in ``timeout`` s."""
    socket.create_connection((host, port), timeout=timeout).close()
