"""The one way kvtier's Python clients talk gRPC: the channel to a kvtier server (kvtierd or
kvtier-agent), a call with its deadline and metadata, and :class:`KvtierError`, whose typed
predicates (``refused``, ``turned_down``, ``timed_out``, ``retryable``, ``session_lost``,
``pool_lost``, ``pool_taken``) come from the status code, never from the message text.

:mod:`kvtier.host` and :mod:`kvtier.agent` build on it; integrations catch ``KvtierError``
(re-exported by :mod:`kvtier.host`) and ask its predicates.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence

import grpc

__all__ = ["DEADLINE_HEADER", "KvtierError", "call", "grpc_channel", "grpc_target", "packed"]

# Messages of a few thousand keys are far below this; the bound is for Stats and metrics.
_MAX_MESSAGE = 64 << 20


class KvtierError(Exception):
    """A call to kvtierd failed; ``retryable`` when the daemon may come back (restart, load)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, lost: str | None = None):
        super().__init__(message)
        self.code = code
        # What a NOT_FOUND says the caller lost (its ``kvtier-lost`` trailer): "session"
        # (kvtierd's) or "pool" (an agent's); None for any other error.
        self.lost = lost if code == grpc.StatusCode.NOT_FOUND else None

    @property
    def refused(self) -> bool:
        """The server turned the call down before doing any of it (bad input, a lost pool,
        a refused registration, no permission)."""
        return self.code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.PERMISSION_DENIED,
        )

    @property
    def invalid_input(self) -> bool:
        """The request itself was wrong; the message names the field."""
        return self.code == grpc.StatusCode.INVALID_ARGUMENT

    @property
    def timed_out(self) -> bool:
        """The call's deadline passed; the server may still be working on it."""
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED

    @property
    def turned_down(self) -> bool:
        """A running server answered and did none of the call: ``refused``, or a method or
        credential it does not take (an older server). Transport failures, deadlines and
        anything the server may have sent half-way are not."""
        return self.refused or self.code in (
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.UNAUTHENTICATED,
        )

    @property
    def retryable(self) -> bool:
        return self.code in (
            None,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )

    @property
    def session_lost(self) -> bool:
        """The daemon no longer knows the session (it expired, or kvtierd restarted): register
        again. Not a prefetch or request that is gone, though that is NOT_FOUND too."""
        return self.lost == "session"

    @property
    def pool_lost(self) -> bool:
        """An agent no longer serves this client's pool (the agent restarted, or the pool was
        registered again): register it again."""
        return self.lost == "pool"

    @property
    def pool_taken(self) -> bool:
        """An agent refused a registration: another live client owns its pool."""
        return self.code == grpc.StatusCode.ALREADY_EXISTS


def packed(keys: Sequence[bytes]) -> bytes:
    """Keys as one ``packed_keys`` field (32 bytes each, back to back). A key of another length
    is refused here, naming it: joined, it would shift every key after it."""
    for i, k in enumerate(keys):
        if len(k) != 32:
            raise KvtierError(
                f"keys[{i}]: a page key is 32 bytes, got {len(k)}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
    return b"".join(keys)


# The metadata header with the wall-clock time (Unix nanoseconds) at which the client gives
# up on a call. gRPC's own ``grpc-timeout`` is relative to when the server reads the request,
# so a call that sat in a stopped or busy server's socket looks fresh; this one does not.
# kvtier-agent closes the call's copy fence at the earlier of the two.
DEADLINE_HEADER = "kvtier-deadline-unix-ns"


def call(
    fn,
    request,
    timeout: float,
    metadata: Sequence[tuple[str, str]] | None = None,
    bare_not_found: str | None = None,
):
    """``fn(request)`` with a deadline; a gRPC error raised as :class:`KvtierError`.
    ``bare_not_found``: what a NOT_FOUND without the kvtier-lost trailer says the caller
    lost, for a call whose every NOT_FOUND is of one thing (an agent's calls: its pool; a
    heartbeat: its session), so a server older than the trailer is read right."""
    deadline = (DEADLINE_HEADER, str(time.time_ns() + int(timeout * 1e9)))
    try:
        return fn(request, timeout=timeout, metadata=[*(metadata or ()), deadline])
    except grpc.RpcError as e:
        err = error(getattr(fn, "_method", b"call"), e)
        if err.code == grpc.StatusCode.NOT_FOUND and err.lost is None:
            err.lost = bare_not_found
        raise err from None


# The trailer of a NOT_FOUND that says what the caller lost ("session" or "pool").
LOST_TRAILER = "kvtier-lost"


def error(method: bytes | str, e: grpc.RpcError) -> KvtierError:
    """``e``, from a call of ``method``, as a :class:`KvtierError` with its code and what it
    says the caller lost."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = method.decode() if isinstance(method, bytes) else str(method)
    lost = None
    trailers = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    for m in trailers or ():
        if m.key == LOST_TRAILER:
            lost = m.value.decode() if isinstance(m.value, bytes) else str(m.value)
    return KvtierError(f"{name}: {code.name if code else 'error'}: {details}", code, lost)


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")


def grpc_target(address: str) -> str:
    """A gRPC target for a socket path (absolute or relative, such as the default
    ``kvtier-data/kvtierd.sock``), a ``unix:`` URI or ``host:port``. Only ``host:port``
    (or a ``dns:``/``ipv4:``/``ipv6:`` URI) is a network address; anything else is a path."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if _HOST_PORT.match(address):
        return address
    return f"unix://{os.path.abspath(address)}"


def grpc_channel(address: str) -> grpc.Channel:
    """A channel to a kvtier server (kvtierd or kvtier-agent) at ``address``."""
    target = grpc_target(address)
    return grpc.insecure_channel(
        target,
        options=[
            # grpcio sends a Unix socket's path as the HTTP/2 authority, which is not a valid
            # authority; servers built on hyper (kvtierd, kvtier-agent) reset such streams.
            *([("grpc.default_authority", "localhost")] if target.startswith("unix:") else []),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # Reconnect quickly after a server restart instead of backing off for minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
    )
