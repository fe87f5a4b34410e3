"""Free ports, this host's address, and TCP reachability."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from loomax.distributed import net
from loomax.distributed.net import check_tcp, ephemeral_ports, free_port, host_ip


def test_free_port_can_be_bound_and_then_answers():
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        check_tcp("127.0.0.1", port, timeout=2.0)
    with pytest.raises(OSError):
        check_tcp("127.0.0.1", port, timeout=2.0)  # nobody listens any more


def test_free_ports_lie_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the ephemeral range, so a port picked
    there may be gone before the server binds it."""
    low, _ = ephemeral_ports()
    ports = {free_port("") for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random: two launches rarely ask for the same port


def test_a_port_held_on_ipv6_only_is_not_free_for_every_interface():
    """A JAX coordinator binds [::]:port, so "free on every interface" checks IPv6 too."""
    try:
        taken = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        pytest.skip("no IPv6 sockets on this host")
    with taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::", 0))
        port = taken.getsockname()[1]
        assert net._bindable("127.0.0.1", port)  # free on IPv4 ...
        assert not net._bindable("", port)  # ... but not for a server on every interface


def test_host_ip_is_an_ipv4_address():
    assert ipaddress.ip_address(host_ip()).version == 4
