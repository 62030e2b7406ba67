"""What both doors (kvtierd's pool door, the agent's memory door) read from a Unix socket."""

from __future__ import annotations

import socket

from kvtier._rpc import KvtierError


def recv_exact(s: socket.socket, n: int, door: str) -> bytes:
    """Exactly ``n`` bytes from ``s``; a ``door`` that closes first is a KvtierError."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise KvtierError(f"the {door} closed before answering")
        buf += chunk
    return bytes(buf)
