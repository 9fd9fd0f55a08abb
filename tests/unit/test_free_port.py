"""free_port hands out ports below the kernel's ephemeral range, which Ray's own sockets
(bound to port 0) can never take between the pick and the server's bind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from iterserve.loadtests.servers import PORT_BAND_LOW, free_port

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="Linux's ephemeral port range is unknown")
def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    ephemeral_low = int(EPHEMERAL.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(PORT_BAND_LOW <= port < ephemeral_low for port in ports)
    assert len(ports) > 1  # chosen at random, not one fixed port
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))
