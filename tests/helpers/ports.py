"""A free loopback port, as a user would pick one for MASTER_PORT or a test server."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port nobody listens on right now, below the ephemeral range (see free_port_block): a
    client that retries connecting to a loopback port in that range before its server is up
    (a health poll, a headless node waiting for its head) can be given that very port as its
    source and connect to itself, holding the port when the server binds ("already in use")."""
    return free_port_block(1)


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (a tensor-parallel engine serves
    on port + rank), taken below Linux's ephemeral range (32768-60999), where the kernel hands
    out the ports of outgoing connections: a block there can lose its second port to one of
    them (gloo's, ZeroMQ's) between this check and the bind."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")
