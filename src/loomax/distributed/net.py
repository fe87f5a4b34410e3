"""Network helpers shared by the multi-process setup here and by ``loomax launch``.

This is the lowest layer of the two: ``loomax.launch`` imports it, it imports nothing of Loomax.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (``""``: every interface) that nothing is bound to right now.

    Racy by nature: the probe socket is closed before this returns, so the port is only
    *likely* to be free when the caller's server (usually a child process: a JAX coordinator,
    a Ray head) binds it moments later; another process may take it in between. A lost race
    shows as that server failing with "address already in use"; pick a new port and start
    it again (``loomax launch --retries`` does so for a local launch, each attempt asking
    for a fresh port). Ports come from the kernel's ephemeral range, so a collision needs
    another process to bind that very port in that window.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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
