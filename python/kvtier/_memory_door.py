"""kvtier-agent's memory door from Python: an engine hands the agent its KV pool's CPU memory
as file descriptors over a Unix socket (``SCM_RIGHTS``), never as a path the agent would
open, and names the deposit in ``RegisterPool`` by the ticket it gets back. The wire is
``CpuPool``'s (proto/kvtier/v1/agent.proto); Rust's side is ``kvtier_shm::memory_door``.
Nothing else in the package speaks it.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence

import grpc

from kvtier._rpc import KvtierError
from kvtier._unix import recv_exact

MAGIC = b"KVTMEM01"
MAX_FDS = 1024
FDS_PER_MESSAGE = 128
TICKET_LEN = 16
MAX_MESSAGE = 1024
# Magic, status, ticket, message length (u16).
_ANSWER = struct.Struct(f"<8sB{TICKET_LEN}sH")


def memfd(name: str, size: int) -> int:
    """A new zeroed memfd of ``size`` bytes, close-on-exec and sealable (the agent seals it
    against shrinking when it maps it). The caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def deposit(path: str, fds: Sequence[int], timeout: float) -> bytes:
    """Deposits ``fds`` (the pool's memory: one layer-first file, or one per allocation) at
    the memory door at ``path``: the ticket naming them in ``RegisterPool``. The caller keeps
    its descriptors. A refusal raises :class:`KvtierError` naming why (``refused``); a door
    that cannot be reached, one that is ``retryable``."""
    if not path:
        raise KvtierError(
            "the agent named no memory door (memory_socket): it is older than this client, "
            "which hands pool memory over only as descriptors; upgrade kvtier-agent"
        )
    if not 0 < len(fds) <= MAX_FDS:
        raise KvtierError(f"a deposit of {len(fds)} descriptors (1 to {MAX_FDS})")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            groups = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)]
            for i, group in enumerate(groups):
                data = MAGIC + struct.pack("<H", len(fds)) if i == 0 else b"+"
                if socket.send_fds(s, [data], list(group)) != len(data):
                    raise KvtierError(f"memory door {path}: a deposit's bytes were cut short")
            magic, status, ticket, n = _ANSWER.unpack(recv_exact(s, _ANSWER.size, "memory door"))
            if magic != MAGIC:
                raise KvtierError(f"{path} is not a kvtier memory door")
            if n > MAX_MESSAGE:
                raise KvtierError(f"{path}: an answer's message of {n} bytes")
            msg = recv_exact(s, n, "memory door").decode("utf-8", "replace") if n else ""
    except OSError as e:
        # The agent may come back: retryable, as an unavailable call is.
        raise KvtierError(f"memory door {path}: {e}", grpc.StatusCode.UNAVAILABLE) from None
    if status == 1:
        raise KvtierError(
            f"memory door {path}: kvtier-agent refused: {msg}", grpc.StatusCode.PERMISSION_DENIED
        )
    if status != 0:
        raise KvtierError(f"memory door {path}: status {status}")
    return ticket
