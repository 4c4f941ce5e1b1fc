"""A free loopback TCP port for a process to bind later.

A port picked by binding port 0 comes from the OS's ephemeral range, the same range it hands
out for outgoing connections and other port-0 binds (gloo's rank connections, gRPC's): in the
seconds before the service binds it, one of those can take it ("address already in use"). So
ports are picked below that range, checked free at the time.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range
LOWEST = 10000


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's /proc setting, else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now and outside the ephemeral range (one from it where nothing lies
    below the range)."""
    lo, _ = ephemeral_range()
    if lo - LOWEST >= 1000:
        for _ in range(64):
            port = random.randrange(LOWEST, lo)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
