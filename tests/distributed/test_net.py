"""Free ports, this host's address, and TCP reachability."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from loomax.distributed.net import check_tcp, free_port, host_ip


def test_free_port_can_be_bound_and_then_answers():
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        check_tcp("127.0.0.1", port, timeout=2.0)
    with pytest.raises(OSError):
        check_tcp("127.0.0.1", port, timeout=2.0)  # nobody listens any more


def test_host_ip_is_an_ipv4_address():
    assert ipaddress.ip_address(host_ip()).version == 4
