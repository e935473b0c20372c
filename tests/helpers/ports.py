"""A free loopback port, as a user would pick one for MASTER_PORT or a test server."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now (the caller binds it; only the engine holds its own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
