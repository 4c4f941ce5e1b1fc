"""Ports picked for services to bind later (specsplit.ports)."""

from __future__ import annotations

import socket

from specsplit.ports import LOWEST, ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    """A picked port is free and outside the range the OS hands out for port-0 binds and
    outgoing connections, so neither takes it before the service binds it."""
    lo, hi = ephemeral_range()
    assert 1024 <= lo < hi <= 65535
    ports = {free_port() for _ in range(20)}
    for port in ports:
        assert (LOWEST <= port < lo) if lo - LOWEST >= 1000 else port > 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with socket.socket() as s:  # an ephemeral port, as gloo or gRPC would get one
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] not in ports
