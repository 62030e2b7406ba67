"""kvtierd's host tier (L2) from Python: a session, its mapped page pool, and the calls of
``kvtier.v1.HostTier`` (proto/kvtier/v1/host.proto says the protocol).

Page bytes never travel over gRPC: :class:`SlotPool` maps the pool whose descriptor kvtierd's
pool door hands the session at registration (``kvtier._pool_door``), and callers copy pages
into or out of the slots the calls hand out.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvtier import _pool_door
from kvtier import keys as _keys
from kvtier._rpc import KvtierError as KvtierError  # integrations catch it from here
from kvtier._rpc import call as _call
from kvtier._rpc import error as _error
from kvtier._rpc import grpc_channel
from kvtier._rpc import packed as _packed
from kvtier.layout import DTYPES as DTYPES  # integrations name dtypes from here
from kvtier.v1 import admin_pb2, admin_pb2_grpc, common_pb2, host_pb2, host_pb2_grpc


def namespace_pb(ns: _keys.Namespace) -> common_pb2.Namespace:
    return common_pb2.Namespace(
        tenant=ns.tenant, cache_salt=ns.cache_salt, lora_id=ns.lora_id, extra_key=ns.extra_key
    )


class DaemonClient:
    """A channel to kvtierd with its services' stubs."""

    def __init__(self, address: str, timeout: float = 5.0):
        self.address = address
        self.timeout = timeout
        self.channel = grpc_channel(address)
        self.host = host_pb2_grpc.HostTierStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def stats(self) -> host_pb2.StatsResponse:
        return _call(self.host.Stats, host_pb2.StatsRequest(), self.timeout)

    def backend_status(self) -> admin_pb2.BackendStatusResponse:
        """The L3 tier: attached, breaker state, counters."""
        return _call(self.admin.BackendStatus, admin_pb2.BackendStatusRequest(), self.timeout)

    def watch_metrics(self, interval_ms: int = 1000) -> Iterator[host_pb2.MetricsSnapshot]:
        """Every daemon metric, every ``interval_ms``, until the caller stops iterating."""
        stream = self.host.WatchMetrics(host_pb2.WatchMetricsRequest(interval_ms=interval_ms))
        try:
            yield from stream
        except grpc.RpcError as e:
            raise _error("WatchMetrics", e) from None
        finally:
            stream.cancel()

    def locate(
        self, layout: str, keys: Sequence[bytes], include_storage: bool = False
    ) -> tuple[int, int]:
        """How many leading ``keys`` (a prompt's page keys, in the caller's tenant) this node
        holds in the pool of layout fingerprint ``layout`` (32 hex digits): ready in L2, and
        after those in L3 when ``include_storage``. No session needed (docs/routing.md)."""
        r = _call(
            self.host.Locate,
            host_pb2.LocateRequest(
                layout=layout, packed_keys=_packed(keys), include_storage=include_storage
            ),
            self.timeout,
        )
        return r.l2_pages, r.l3_pages

    def register(
        self,
        name: str,
        layout: common_pb2.LayoutDescriptor,
        namespace: _keys.Namespace = _keys.Namespace(),
    ) -> HostSession:
        return HostSession.register(self, name, layout, namespace)

    def close(self) -> None:
        self.channel.close()


class SlotPool:
    """The daemon's page pool, mapped: ``slots`` slots of ``stride`` bytes."""

    def __init__(self, fd: int, name: str, slots: int, stride: int):
        """Maps the pool behind ``fd`` (closed here, mapped or not); ``name`` is for
        messages."""
        self.path, self.slots, self.stride = name, slots, stride
        size = slots * stride
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise KvtierError(
                    f"pool {name} is {actual} bytes, expected {slots} slots x {stride}"
                )
            # MAP_POPULATE: fault every page of the pool in now, not one 4 KiB page at a time
            # inside the first copies (which halved the first writes' speed).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(self._anchor)

    def address(self, slot: int, offset: int = 0, length: int = 0) -> int:
        """The address of ``length`` bytes at ``offset`` in ``slot``, bounds-checked."""
        if not 0 <= slot < self.slots:
            raise KvtierError(f"slot {slot} is outside the pool's {self.slots} slots")
        if offset < 0 or length < 0 or offset + length > self.stride:
            raise KvtierError(
                f"bytes {offset}..{offset + length} exceed the slot stride {self.stride}"
            )
        return self.base + slot * self.stride + offset

    def view(self, slot: int, length: int) -> memoryview:
        start = slot * self.stride
        self.address(slot, 0, length)
        return memoryview(self._map)[start : start + length]

    def close(self) -> None:
        """Unmaps the pool (again: nothing)."""
        if getattr(self, "_anchor", None) is None:
            return
        self._anchor = None
        try:
            self._map.close()
        except BufferError:
            # A view is still held somewhere; the mapping goes when it does.
            pass


@dataclass
class Progress:
    """A prefetch's progress (host.proto PrefetchProgress)."""

    state: str
    reason: str
    l2_pages: int
    hit_pages: int
    landed_pages: int

    @staticmethod
    def of(p: host_pb2.PrefetchProgress) -> Progress:
        return Progress(
            state=host_pb2.PrefetchState.Name(p.state).removeprefix("PREFETCH_STATE_").lower(),
            reason=p.reason,
            l2_pages=p.l2_pages,
            hit_pages=p.hit_pages,
            landed_pages=p.landed_pages,
        )


POLICIES = {
    "best_effort": host_pb2.PREFETCH_POLICY_BEST_EFFORT,
    "wait_complete": host_pb2.PREFETCH_POLICY_WAIT_COMPLETE,
    "timeout": host_pb2.PREFETCH_POLICY_TIMEOUT,
}


def final_progress(
    method, request, timeout: float, metadata: Sequence[tuple[str, str]] = ()
) -> Progress:
    """Calls a Prefetch stream (kvtierd's or an agent's) and returns its last message: the
    prefetch's final state."""
    last = None
    try:
        for p in method(request, timeout=timeout, metadata=list(metadata) or None):
            last = p
    except grpc.RpcError as e:
        raise _error("Prefetch", e) from None
    if last is None:
        raise KvtierError("Prefetch: the stream ended without progress")
    return Progress.of(last)


@dataclass(frozen=True)
class Stored:
    """How a :meth:`HostSession.store` ended."""

    # Leading keys L2 now holds: the first key it had no room for ends them.
    held: int
    # Indexes (into the keys given) of the pages this call wrote.
    copied: list[int]
    # Indexes of pages L2 held already: another writer's, which may not be visible yet
    # (committed by then, or given up).
    present: list[int]


# A copy into or out of a slot: (index into the keys given, the slot's address).
SlotCopy = Callable[[int, int], None]


@dataclass
class HostSession:
    """A registered session: its id, lease, layout as the daemon derived it, and its pool."""

    client: DaemonClient
    # Opaque (24 bytes: the daemon run's epoch and 16 random bytes); send it back as is.
    session_id: bytes
    ttl_s: float
    info: common_pb2.LayoutInfo
    pool: SlotPool
    closed: bool = False
    _heartbeats: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    # Calls copying through the pool now (`in_use`): the pool is unmapped only when none is.
    _users: int = field(default=0, repr=False)
    _users_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    SELF_TEST_PAGES = 2

    @classmethod
    def register(
        cls,
        client: DaemonClient,
        name: str,
        layout: common_pb2.LayoutDescriptor,
        namespace: _keys.Namespace = _keys.Namespace(),
    ) -> HostSession:
        tokens = list(range(1, layout.page_size * cls.SELF_TEST_PAGES + 1))
        test = common_pb2.HashSelfTest(
            page_size=layout.page_size,
            namespace=namespace_pb(namespace),
            tokens=tokens,
            keys=_keys.page_keys(tokens, layout.page_size, namespace),
        )
        r = _call(
            client.host.Register,
            host_pb2.RegisterRequest(name=name, layout=layout, hash_self_test=test),
            client.timeout,
        )
        fd, slots, stride = _pool_door.fetch(r.pool_socket, r.session_id, client.timeout)
        if (slots, stride) != (r.pool_slots, r.slot_stride):
            os.close(fd)
            raise KvtierError(
                f"the pool door's pool ({slots} slots of {stride} bytes) is not the one "
                f"Register described ({r.pool_slots} of {r.slot_stride})"
            )
        pool = SlotPool(fd, r.pool_path, slots, stride)
        return cls(client, r.session_id, r.ttl_ms / 1000.0, r.layout, pool)

    @property
    def page_bytes(self) -> int:
        return self.info.page_bytes

    @property
    def label(self) -> str:
        """The session as kvtierd's logs and ``kvtierctl status`` show it: the run's epoch and
        the first 8 hex digits of the nonce (never the whole id, which is the session's
        secret)."""
        epoch = int.from_bytes(self.session_id[:8], "little")
        return f"{epoch:x}-{self.session_id[8:12].hex()}"

    def _t(self, timeout: float | None) -> float:
        return self.client.timeout if timeout is None else timeout

    def lookup(
        self, keys: Sequence[bytes], include_storage: bool = False, timeout: float | None = None
    ) -> tuple[int, int]:
        """(leading keys ready in L2, keys after those a prefetch can bring in from L3)."""
        r = _call(
            self.client.host.Lookup,
            host_pb2.LookupRequest(
                session_id=self.session_id,
                packed_keys=_packed(keys),
                include_storage=include_storage,
            ),
            self._t(timeout),
        )
        return r.ready_pages, r.storage_pages

    def lookup_each(
        self, keys: Sequence[bytes], include_storage: bool = False, timeout: float | None = None
    ) -> list[bool]:
        """Key by key (not only the leading run): whether each is ready in L2 or, with
        ``include_storage``, held by L3."""
        r = _call(
            self.client.host.Lookup,
            host_pb2.LookupRequest(
                session_id=self.session_id,
                packed_keys=_packed(keys),
                include_storage=include_storage,
                each_key=True,
            ),
            self._t(timeout),
        )
        if len(r.present) != len(keys):
            raise KvtierError(f"Lookup answered {len(r.present)} flags for {len(keys)} keys")
        return list(r.present)

    def reserve(
        self, keys: Sequence[bytes], parent: bytes = b"", timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """(status, slot) per key; status is a ``host_pb2.ReserveStatus`` value."""
        r = _call(
            self.client.host.Reserve,
            host_pb2.ReserveRequest(
                session_id=self.session_id, packed_keys=_packed(keys), parent=parent
            ),
            self._t(timeout),
        )
        if len(r.status) != len(keys) or len(r.slots) != len(keys):
            raise KvtierError(f"Reserve answered {len(r.status)} statuses for {len(keys)} keys")
        return list(zip(r.status, r.slots))

    def commit(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        _call(
            self.client.host.Commit,
            host_pb2.CommitRequest(session_id=self.session_id, packed_keys=_packed(keys)),
            self._t(timeout),
        )

    def abort(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        _call(
            self.client.host.Abort,
            host_pb2.AbortRequest(session_id=self.session_id, packed_keys=_packed(keys)),
            self._t(timeout),
        )

    def acquire(self, keys: Sequence[bytes], timeout: float | None = None) -> list[int]:
        """Pins the longest ready prefix of ``keys``; its slots."""
        r = _call(
            self.client.host.Acquire,
            host_pb2.AcquireRequest(session_id=self.session_id, packed_keys=_packed(keys)),
            self._t(timeout),
        )
        return list(r.slots)

    def release(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        """Drops pins. Raises when they were already dropped: bytes copied under them are void."""
        _call(
            self.client.host.Release,
            host_pb2.ReleaseRequest(session_id=self.session_id, packed_keys=_packed(keys)),
            self._t(timeout),
        )

    # ---- the page protocol: the one place Python writes and reads L2 pages ---------------

    def store(
        self,
        keys: Sequence[bytes],
        fill: SlotCopy,
        parent: bytes = b"",
        timeout: float | None = None,
    ) -> Stored:
        """Writes pages: Reserve, ``fill(i, address)`` for each page this session is to write,
        Commit. Other sessions see a page only once it is committed. Stops at the first page
        L2 has no room for. When a copy or the Commit fails, what was reserved is aborted
        (never left to the session's expiry) and the error raised."""
        answers = self.reserve(keys, parent, timeout)
        held = len(keys)
        copied: list[int] = []
        present: list[int] = []
        try:
            for i, (status, slot) in enumerate(answers):
                if status == host_pb2.RESERVE_STATUS_PRESENT:
                    present.append(i)
                elif status == host_pb2.RESERVE_STATUS_RESERVED:
                    copied.append(i)
                    fill(i, self.pool.address(slot, 0, self.page_bytes))
                else:
                    # No room in L2 now; every later key is refused too.
                    held = i
                    break
            if copied:
                self.commit([keys[i] for i in copied], timeout)
        except BaseException:
            if copied:
                with contextlib.suppress(KvtierError):
                    self.abort([keys[i] for i in copied], timeout)
            raise
        return Stored(held, copied, present)

    def read_pinned(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        read: SlotCopy,
        timeout: float | None = None,
    ) -> int:
        """Reads pages pinned for ``keys[:len(slots)]`` (by :meth:`acquire` or
        :meth:`take_prefetch`): ``read(i, address)`` for each, then releases the pins, even
        when a copy failed. A failed Release raises: the pins were dropped while copying, so
        the bytes read are void. Returns how many pages were read."""
        if not slots:
            return 0
        try:
            for i, slot in enumerate(slots):
                read(i, self.pool.address(slot, 0, self.page_bytes))
        finally:
            self.release(keys[: len(slots)], timeout)
        return len(slots)

    def load(self, keys: Sequence[bytes], read: SlotCopy, timeout: float | None = None) -> int:
        """Reads the longest prefix of ``keys`` L2 holds: Acquire, then :meth:`read_pinned`.
        Returns how many pages were read."""
        return self.read_pinned(keys, self.acquire(keys, timeout), read, timeout)

    def prefetch(
        self,
        request_id: str,
        keys: Sequence[bytes],
        parent: bytes = b"",
        policy: str = "wait_complete",
        timeout_ms: int = 0,
        threshold_tokens: int | None = None,
        recompute_tokens_per_second: int = 0,
        timeout: float | None = None,
    ) -> Progress:
        """Loads ``keys`` from L3 into L2 and waits for the prefetch's final state. Zero or
        None hints keep the daemon's configuration (host.proto PrefetchHints)."""
        hints = host_pb2.PrefetchHints(
            timeout_ms=timeout_ms, recompute_tokens_per_second=recompute_tokens_per_second
        )
        if threshold_tokens is not None:
            hints.threshold_tokens = threshold_tokens
        req = host_pb2.PrefetchRequest(
            session_id=self.session_id,
            request_id=request_id,
            packed_keys=_packed(keys),
            parent=parent,
            policy=POLICIES[policy],
            hints=hints,
        )
        return final_progress(self.client.host.Prefetch, req, self._t(timeout))

    def take_prefetch(
        self, request_id: str, timeout: float | None = None
    ) -> tuple[Progress, list[int]]:
        """Pins the prefetch's usable prefix; its progress and slots (copy, then release)."""
        r = _call(
            self.client.host.TakePrefetch,
            host_pb2.TakePrefetchRequest(session_id=self.session_id, request_id=request_id),
            self._t(timeout),
        )
        return Progress.of(r.progress), list(r.slots)

    def release_prefetch(self, request_id: str, timeout: float | None = None) -> None:
        _call(
            self.client.host.ReleasePrefetch,
            host_pb2.ReleasePrefetchRequest(session_id=self.session_id, request_id=request_id),
            self._t(timeout),
        )

    def heartbeat(self, timeout: float | None = None) -> None:
        # A heartbeat's only NOT_FOUND is of its session (a kvtierd older than the
        # kvtier-lost trailer says so by its code alone).
        r = _call(
            self.client.host.Heartbeat,
            host_pb2.HeartbeatRequest(session_id=self.session_id),
            self._t(timeout),
            bare_not_found="session",
        )
        if r.ttl_ms:
            self.ttl_s = r.ttl_ms / 1000.0

    def start_heartbeats(self, on_lost=None) -> None:
        """Heartbeats every third of the lease on a daemon thread. ``on_lost(error)`` is
        called once when the daemon no longer knows the session (or cannot be reached for a
        whole lease); the thread then stops."""

        def run() -> None:
            failing_since = None
            while not self._stop.wait(max(self.ttl_s / 3.0, 0.05)):
                try:
                    self.heartbeat()
                    failing_since = None
                except KvtierError as e:
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if e.session_lost or now - failing_since >= self.ttl_s:
                        self.abandon()
                        if on_lost is not None:
                            on_lost(e)
                        return

        self._heartbeats = threading.Thread(
            target=run, name=f"kvtier-heartbeat-{self.label}", daemon=True
        )
        self._heartbeats.start()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[HostSession]:
        """Holds the pool mapped for the calls and copies inside the block. Raises
        ``KvtierError`` (session lost) when the session was already given up."""
        with self._users_lock:
            if self.closed:
                raise KvtierError("the session was given up", grpc.StatusCode.NOT_FOUND, "session")
            self._users += 1
        try:
            yield self
        finally:
            with self._users_lock:
                self._users -= 1
                unmap = self.closed and self._users == 0
            if unmap:
                self.pool.close()

    def abandon(self) -> None:
        """Gives up a session the daemon no longer serves (it expired, or kvtierd restarted):
        no Close call; heartbeats stop, and the pool is unmapped once no call is using it (a
        dead daemon's pool file may already be removed, but a mapping keeps its memory)."""
        self._stop.set()
        with self._users_lock:
            self.closed = True
            unmap = self._users == 0
        if unmap:
            self.pool.close()

    def close(self) -> None:
        """Ends the session (its pins and reservations are dropped) and unmaps the pool."""
        self._stop.set()
        if not self.closed:
            self.closed = True
            try:
                _call(
                    self.client.host.Close,
                    host_pb2.CloseRequest(session_id=self.session_id),
                    self.client.timeout,
                )
            except KvtierError:
                pass
        self.pool.close()
