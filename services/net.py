"""Loopback networking: every server ProxyDML starts listens on 127.0.0.1 only."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the kernel picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    """True when something listens on 127.0.0.1:port (or on all addresses).

    SO_REUSEADDR makes the probe ignore sockets in TIME_WAIT left by a server we just stopped
    (on Linux it still fails when a socket is listening), so a quick restart is not refused.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False
