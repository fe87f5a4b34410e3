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


def test_free_ports_lie_below_the_ephemeral_range_and_on_every_interface():
    """Outgoing connections take their local ports from the ephemeral range, so a port picked
    there may be gone before the server binds it; and a coordinator binds [::], not 127.0.0.1."""
    low, _ = ephemeral_ports()
    ports = {free_port("") for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random: two launches rarely ask for the same port
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken:
        taken.bind(("::", 0))
        port = taken.getsockname()[1]
        assert not net._bindable("", port)  # held on IPv6 only: not free for a [::] server


def test_host_ip_is_an_ipv4_address():
    assert ipaddress.ip_address(host_ip()).version == 4
