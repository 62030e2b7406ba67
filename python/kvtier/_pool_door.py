"""kvtierd's pool door from Python: a registered session's L2 pool arrives as a file
descriptor over a Unix socket (``SCM_RIGHTS``), never as a path to open. The wire is
``RegisterResponse.pool_socket``'s (proto/kvtier/v1/host.proto); Rust's side is
``kvtier_shm::door``. Nothing else in the package speaks it.
"""

from __future__ import annotations

import os
import socket
import struct

import grpc

from kvtier._rpc import KvtierError
from kvtier._unix import recv_exact

MAGIC = b"KVTPOOL1"
MAX_SESSION = 64
MAX_MESSAGE = 1024
# Magic, status, slots (u32), stride (u64), message length (u16).
_ANSWER = struct.Struct("<8sBIQH")


def fetch(path: str, session_id: bytes, timeout: float) -> tuple[int, int, int]:
    """The descriptor of ``session_id``'s pool from the door at ``path``, with its slots and
    stride. The caller owns the descriptor. A refusal raises :class:`KvtierError` naming
    why (``refused``); a door that cannot be reached, one that is ``retryable``."""
    if not path:
        raise KvtierError(
            "kvtierd named no pool door (pool_socket): it is older than this client, which "
            "maps pools only from descriptors; upgrade kvtierd"
        )
    if not 0 < len(session_id) <= MAX_SESSION:
        raise KvtierError(f"a session id of {len(session_id)} bytes (1 to {MAX_SESSION})")
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            # No bearer token: this client reaches kvtierd on its Unix socket only.
            s.sendall(MAGIC + struct.pack("<HH", len(session_id), 0) + session_id)
            # Close-on-exec from the start: a fork and exec in another thread never inherits it.
            head, fds, _, _ = socket.recv_fds(s, _ANSWER.size, 2, socket.MSG_CMSG_CLOEXEC)
            if len(head) < _ANSWER.size:
                head += recv_exact(s, _ANSWER.size - len(head), "pool door")
            magic, status, slots, stride, n = _ANSWER.unpack(head)
            if magic != MAGIC:
                raise KvtierError(f"{path} is not a kvtier pool door")
            if n > MAX_MESSAGE:
                raise KvtierError(f"{path}: an answer's message of {n} bytes")
            msg = recv_exact(s, n, "pool door").decode("utf-8", "replace") if n else ""
    except OSError as e:
        for fd in fds:
            os.close(fd)
        # The daemon may come back: retryable, as an unavailable call is.
        raise KvtierError(f"pool door {path}: {e}", grpc.StatusCode.UNAVAILABLE) from None
    except KvtierError:
        for fd in fds:
            os.close(fd)
        raise
    if status != 0 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if status == 1:
            raise KvtierError(
                f"pool door {path}: kvtierd refused: {msg}", grpc.StatusCode.PERMISSION_DENIED
            )
        raise KvtierError(f"pool door {path}: status {status} with {len(fds)} descriptors")
    return fds[0], slots, stride
