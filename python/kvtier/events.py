"""What kvtierd nodes hold, from their ``WatchEvents`` streams (docs/routing.md), for routers.

- :func:`watch` reads one node's stream as typed :class:`EventBatch` es.
- :class:`NodeView` applies a node's events: the keys it holds per layout, the stream's id and
  the last ``seq`` applied (what a resume names).
- :class:`Follower` follows one node's stream on a thread, resuming after a disconnect.
- :class:`FleetIndex` keeps a view per node, follows each node's stream on a thread (resuming
  after a disconnect, rebuilding from the snapshot after a restart or a resync), and answers
  where a prompt's pages are: :meth:`FleetIndex.locate` (leading pages per node) and
  :meth:`FleetIndex.route` (the node with the longest prefix), each by scanning every node's
  view; it tells an index built over it (``changes``, :data:`FleetChanges`) each page a view
  gains or loses, as :class:`kvtier.routing.Router` uses it to choose a node without scans.

Keys are kvtierd's: a prompt's page keys (:func:`kvtier.keys.page_keys`), scoped by tenant
when the nodes run with ``[tenants]`` (docs/routing.md gives the scope).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvtier._rpc import KvtierError
from kvtier._rpc import error as _error
from kvtier.host import DaemonClient
from kvtier.v1 import host_pb2

_log = logging.getLogger(__name__)


class EventKind(enum.Enum):
    STORED = host_pb2.PAGE_EVENT_KIND_STORED
    REMOVED = host_pb2.PAGE_EVENT_KIND_REMOVED
    CLEARED = host_pb2.PAGE_EVENT_KIND_CLEARED
    RESYNC = host_pb2.PAGE_EVENT_KIND_RESYNC


class EventTier(enum.Enum):
    """Where the page is: kvtierd's shared host memory (L2), or its storage tier (L3) as far
    as that kvtierd knows (docs/routing.md)."""

    L2_HOST = host_pb2.EVENT_TIER_L2_HOST
    L3_STORAGE = host_pb2.EVENT_TIER_L3_STORAGE


@dataclass(frozen=True)
class PageEvent:
    """One event. ``seq`` is 0 on a snapshot's pages; ``layout`` is empty on a CLEARED of every
    layout and on a RESYNC. ``tenant_tag`` is set on a CLEARED of one tenant's own pool: the
    tag (first 8 bytes, big-endian) of that tenant's keys; 0 when every tenant's pages of
    ``layout`` went."""

    seq: int
    unix_nanos: int
    kind: EventKind
    key: bytes
    parent: bytes | None
    layout: str
    tier: EventTier
    tenant_tag: int = 0

    @staticmethod
    def of(e: host_pb2.PageEvent) -> PageEvent:
        try:
            kind = EventKind(e.kind)
        except ValueError:
            raise KvtierError(f"events: kind {e.kind} is not an event kind") from None
        if kind in (EventKind.STORED, EventKind.REMOVED) and len(e.key) != 32:
            raise KvtierError(f"events: key: a page key is 32 bytes, got {len(e.key)}")
        try:
            tier = EventTier(e.tier)
        except ValueError:
            raise KvtierError(f"events: tier {e.tier} is not a tier") from None
        return PageEvent(
            e.seq, e.unix_nanos, kind, e.key, e.parent or None, e.layout, tier, e.tenant_tag
        )


@dataclass(frozen=True)
class EventBatch:
    stream_id: int
    node: str
    events: tuple[PageEvent, ...]


def watch(client: DaemonClient, stream_id: int = 0, after_seq: int = 0) -> Iterator[EventBatch]:
    """A node's events: after ``after_seq`` of stream ``stream_id`` when it still has them, else
    from a RESYNC and a snapshot. Ends when the caller stops iterating; a broken stream raises
    :class:`KvtierError` with its code."""
    stream = client.host.WatchEvents(
        host_pb2.WatchEventsRequest(stream_id=stream_id, after_seq=after_seq)
    )
    try:
        for b in stream:
            yield EventBatch(b.stream_id, b.node, tuple(PageEvent.of(e) for e in b.events))
    except grpc.RpcError as e:
        raise _error("WatchEvents", e) from None
    finally:
        stream.cancel()


def _tag(key: bytes) -> int:
    # A page key's last 8 bytes: SHA-256 output, and unlike the first 8 not shared by a
    # tenant's pages (docs/routing.md).
    return int.from_bytes(key[24:32], "little")


class KeySet:
    """Page keys held, in about 9 bytes a page: each key's last 64 bits, in sorted arrays of
    at most :attr:`LEAF` values (a two-level B-tree in ``array('Q')`` s, no Python object per
    key). Two keys that agree in those 64 bits are one entry: a router may then send a
    request where one page is not, which costs a miss there, never wrong data (pages are
    read by their full key). The chance is about n²/2⁶⁵ for n keys: 3·10⁻⁶ at 10 million."""

    LEAF = 4096

    __slots__ = ("_leaves", "_mins", "_len")

    def __init__(self) -> None:
        self._leaves: list[array[int]] = [array("Q")]
        self._mins: list[int] = [0]
        self._len = 0

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        at, i, t = self._find(key)
        leaf = self._leaves[at]
        return i < len(leaf) and leaf[i] == t

    def __len__(self) -> int:
        return self._len

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held (one pass, no call per key)."""
        mins, leaves = self._mins, self._leaves
        n = 0
        for k in keys:
            t = int.from_bytes(k[24:32], "little")
            leaf = leaves[bisect_right(mins, t) - 1]
            i = bisect_left(leaf, t)
            if i == len(leaf) or leaf[i] != t or len(k) != 32:
                break
            n += 1
        return n

    def _find(self, key: bytes) -> tuple[int, int, int]:
        """(the leaf where ``key``'s tag belongs, its index there, the tag)."""
        t = _tag(key)
        at = bisect_right(self._mins, t) - 1
        return at, bisect_left(self._leaves[at], t), t

    def tags(self) -> Iterator[int]:
        """Each key's tag (its last 64 bits, little-endian), ascending."""
        for leaf in self._leaves:
            yield from leaf

    def add(self, key: bytes) -> bool:
        """Adds ``key``; whether it was new."""
        at, i, t = self._find(key)
        leaf = self._leaves[at]
        if i < len(leaf) and leaf[i] == t:
            return False
        leaf.insert(i, t)
        self._len += 1
        if len(leaf) > self.LEAF:
            half = len(leaf) // 2
            right = leaf[half:]
            del leaf[half:]
            self._leaves.insert(at + 1, right)
            self._mins.insert(at + 1, right[0])
        return True

    def discard(self, key: bytes) -> bool:
        """Removes ``key``; whether it was held."""
        at, i, t = self._find(key)
        leaf = self._leaves[at]
        if i == len(leaf) or leaf[i] != t:
            return False
        del leaf[i]
        self._len -= 1
        if not leaf and len(self._leaves) > 1:
            del self._leaves[at]
            del self._mins[at]
            self._mins[0] = 0
        return True

    def copy(self) -> KeySet:
        c = KeySet()
        c._leaves = [array("Q", leaf) for leaf in self._leaves]
        c._mins = list(self._mins)
        c._len = self._len
        return c


PageChanges = Callable[[EventTier, str, Iterable[int], bool], None]
"""What :meth:`NodeView.apply` tells of each change: ``(tier, layout, tags, held)``: the pages
whose tags (each key's last 64 bits, as :class:`KeySet` keeps them) became held in ``layout``
of ``tier`` (``held`` true) or left it. Called only for real changes: a page stored twice or
removed when not held is not told."""

FleetChanges = Callable[[str, EventTier, str, Iterable[int], bool], None]
""":data:`PageChanges` with the node's name first, as :class:`FleetIndex` tells them."""


@dataclass
class NodeView:
    """What one node holds, from its events: keys per layout fingerprint, in L2 (``pages``)
    and in L3 as far as the node knows (``storage``)."""

    pages: dict[str, KeySet] = field(default_factory=dict)
    stream_id: int = 0
    last_seq: int = 0
    resyncs: int = 0
    storage: dict[str, KeySet] = field(default_factory=dict)

    def _tier(self, tier: EventTier) -> dict[str, KeySet]:
        return self.pages if tier is EventTier.L2_HOST else self.storage

    def apply(self, batch: EventBatch, changes: PageChanges | None = None) -> None:
        """Applies ``batch``; ``changes``, when given, is told each page that became held or
        left (what an index over many views, as :class:`kvtier.routing.Router` keeps,
        follows). When ``changes`` raises (its own change undone, as the router's is), the
        view undoes its side of that event and the error propagates: the batch is then
        applied up to the event that failed, view and index agreeing, and ``last_seq`` is
        the last event applied's."""
        self.stream_id = batch.stream_id
        for e in batch.events:
            tier = self._tier(e.tier)
            if e.kind is EventKind.STORED:
                held = tier.get(e.layout)
                if held is None:
                    held = tier[e.layout] = KeySet()
                if held.add(e.key) and changes is not None:
                    try:
                        changes(e.tier, e.layout, (_tag(e.key),), True)
                    except BaseException:
                        held.discard(e.key)
                        if not held:
                            del tier[e.layout]
                        raise
            elif e.kind is EventKind.REMOVED:
                held = tier.get(e.layout)
                if held is not None and held.discard(e.key):
                    if changes is not None:
                        try:
                            changes(e.tier, e.layout, (_tag(e.key),), False)
                        except BaseException:
                            held.add(e.key)
                            raise
                    if not held:
                        del tier[e.layout]  # a layout's last page: no empty set kept
            elif e.kind is EventKind.CLEARED:
                # One tenant's pool (tenant_tag) or every tenant's: the key sets keep each
                # key's last 8 bytes, not its tenant tag, so either way the layout's set goes
                # (another tenant's pages forgotten cost a miss there, never a wrong route).
                self._drop(e.tier, [e.layout] if e.layout else list(tier), changes)
            else:  # RESYNC: a snapshot follows
                self.forget(changes)
                self.resyncs += 1
            if e.seq:
                self.last_seq = e.seq

    def _drop(self, tier: EventTier, layouts: Iterable[str], changes: PageChanges | None) -> None:
        """Forgets ``tier``'s pages of ``layouts``, each layout's set leaving the view once
        ``changes`` has taken its pages (so a failure leaves the rest held and told)."""
        sets = self._tier(tier)
        for name in layouts:
            gone = sets.get(name)
            if gone is None:
                continue
            if changes is not None:
                changes(tier, name, gone.tags(), False)
            del sets[name]

    def forget(self, changes: PageChanges | None = None) -> None:
        """Forgets every page (each told to ``changes``), as a RESYNC does."""
        for t in EventTier:
            self._drop(t, list(self._tier(t)), changes)

    def held(self, tier: EventTier = EventTier.L2_HOST) -> int:
        """Pages held in ``tier``, over every layout."""
        return sum(len(s) for s in self._tier(tier).values())

    def prefix(
        self,
        keys: Sequence[bytes],
        layout: str | None = None,
        tier: EventTier | None = EventTier.L2_HOST,
    ) -> int:
        """Leading ``keys`` held in ``layout`` (the longest over every layout when ``None``)
        in ``tier``; with ``tier=None``, each page in L2 or L3."""
        names = self.pages.keys() | self.storage.keys() if layout is None else [layout]
        best = 0
        for name in names:
            l2, l3 = self.pages.get(name, KeySet()), self.storage.get(name, KeySet())
            if tier is EventTier.L2_HOST:
                n = l2.leading(keys)
            elif tier is EventTier.L3_STORAGE:
                n = l3.leading(keys)
            else:
                n = 0
                for k in keys:
                    if k not in l2 and k not in l3:
                        break
                    n += 1
            best = max(best, n)
        return best

    def copy(self) -> NodeView:
        return NodeView(
            {k: s.copy() for k, s in self.pages.items()},
            self.stream_id,
            self.last_seq,
            self.resyncs,
            {k: s.copy() for k, s in self.storage.items()},
        )


class FleetIndex:
    """Views of many nodes, each kept by following its stream (:meth:`follow`)."""

    def __init__(self, changes: FleetChanges | None = None) -> None:
        """``changes``, when given, is told each page that became held or left a node's view
        (:data:`FleetChanges`), under the index's lock, as each batch is applied."""
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeView] = {}
        self._followers: dict[str, Follower] = {}
        self._errors: dict[str, int] = {}
        self._changes = changes

    def _tell(self, node: str) -> PageChanges | None:
        return None if self._changes is None else functools.partial(self._changes, node)

    def apply(self, node: str, batch: EventBatch) -> None:
        """Applies ``node``'s ``batch`` to its view (:meth:`NodeView.apply`: should it raise,
        the view and ``changes`` agree on what of the batch was applied)."""
        with self._lock:
            self._nodes.setdefault(node, NodeView()).apply(batch, self._tell(node))

    def _apply_followed(self, node: str, follower: Follower, batch: EventBatch) -> None:
        with self._lock:
            if self._followers.get(node) is not follower:
                return  # a follower stopped (node removed or followed anew): not its view now
            self._nodes.setdefault(node, NodeView()).apply(batch, self._tell(node))

    def _failed(self, node: str, follower: Follower) -> None:
        # A follower's batch raised something else than a KvtierError: the node's view may
        # miss part of that batch, so forget it; the follower starts over from a snapshot.
        with self._lock:
            if self._followers.get(node) is not follower:
                return
            self._errors[node] = self._errors.get(node, 0) + 1
            view = self._nodes.get(node)
            if view is not None:
                view.forget(self._tell(node))
                view.stream_id = view.last_seq = 0

    def errors(self) -> dict[str, int]:
        """Per followed node, how many times applying its stream raised an error other than
        a :class:`KvtierError` (a broken stream), each after which the follower forgot the
        node's pages and started over from a snapshot (:class:`Follower`)."""
        with self._lock:
            return dict(self._errors)

    def view(self, node: str) -> NodeView:
        """A copy of ``node``'s view now."""
        with self._lock:
            return self._nodes.get(node, NodeView()).copy()

    def locate(
        self,
        keys: Sequence[bytes],
        layout: str | None = None,
        tier: EventTier | None = EventTier.L2_HOST,
    ) -> dict[str, int]:
        """For each node, how many leading ``keys`` it holds in ``tier`` (``None``: each page in
        L2 or L3)."""
        with self._lock:
            return {name: v.prefix(keys, layout, tier) for name, v in self._nodes.items()}

    def route(
        self,
        keys: Sequence[bytes],
        layout: str | None = None,
        tier: EventTier | None = EventTier.L2_HOST,
    ) -> tuple[str, int] | None:
        """The node holding the longest prefix of ``keys`` in ``tier`` and its length; ``None``
        when no node holds the first page (any node will do)."""
        found = self.locate(keys, layout, tier)
        best = max(sorted(found.items()), key=lambda kv: kv[1], default=None)
        return best if best is not None and best[1] > 0 else None

    def follow(self, node: str, address: str, retry_s: float = 0.2) -> None:
        """Follows the stream of the kvtierd at ``address`` as ``node``, on a thread, until
        :meth:`close` or :meth:`remove`: it resumes after a disconnect from the last event
        applied, and rebuilds from the snapshot when the node restarted or the resume fell
        out of its window. Following a node already followed stops the old follower first.
        A batch that raises anything else than a :class:`KvtierError` is logged and counted
        (:meth:`errors`); the node's pages are forgotten and the follower starts over from a
        snapshot."""

        def position() -> tuple[int, int]:
            v = self.view(node)
            return v.stream_id, v.last_seq

        f: Follower = Follower(
            address,
            lambda b: self._apply_followed(node, f, b),
            position,
            retry_s,
            name=f"kvtier-events-{node}",
            on_error=lambda _e: self._failed(node, f),
        )
        with self._lock:
            old = self._followers.get(node)
            self._nodes.setdefault(node, NodeView())
            self._followers[node] = f
        if old is not None:
            old.stop()
        f.start()

    def remove(self, node: str) -> bool:
        """Stops following ``node`` and forgets its view (each page told to ``changes``);
        whether it was known. Followed or applied again later, it starts from an empty
        view."""
        with self._lock:
            f = self._followers.pop(node, None)
        if f is not None:
            f.stop()
        with self._lock:
            self._errors.pop(node, None)
            view = self._nodes.get(node)
            if view is None:
                return f is not None
            view.forget(self._tell(node))
            del self._nodes[node]
            return True

    def close(self) -> None:
        with self._lock:
            followers = list(self._followers.values())
            self._followers.clear()
        for f in followers:
            f.stop()

    def __enter__(self) -> FleetIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Follower(threading.Thread):
    """Follows one kvtierd's stream on a thread until :meth:`stop`: each batch goes to
    ``apply``; after a disconnect it resumes from ``position()`` (the stream id and last
    ``seq`` applied), and a node that restarted or a resume past its window starts over from
    a RESYNC and a snapshot. What :class:`FleetIndex` and the vLLM event bridge
    (:mod:`kvtier.integrations.vllm.kv_events`) follow nodes with.

    A :class:`KvtierError` (the node went away or restarted) is resumed from. Any other
    error (``apply`` raised, say) is logged, counted in :attr:`errors` (the last in
    :attr:`last_error`), told to ``on_error`` when given, and the follower starts over from
    a RESYNC and a snapshot after ``retry_s``: the thread never dies of it."""

    def __init__(
        self,
        address: str,
        apply: Callable[[EventBatch], None],
        position: Callable[[], tuple[int, int]],
        retry_s: float = 0.2,
        name: str = "kvtier-events",
        on_error: Callable[[Exception], None] | None = None,
    ):
        super().__init__(name=name, daemon=True)
        self.address, self.retry_s = address, retry_s
        self._apply, self._position, self._on_error = apply, position, on_error
        #: Errors other than a KvtierError met following the stream (each a fresh start).
        self.errors = 0
        self.last_error: Exception | None = None
        self._stop_event = threading.Event()
        self._resync = threading.Event()
        self._client: DaemonClient | None = None
        self._client_lock = threading.Lock()

    def resync(self) -> None:
        """Starts over from a RESYNC and a snapshot: after the batch being applied when called
        from ``apply`` itself; at once from another thread (the stream, which may be waiting
        for a batch that never comes, is closed)."""
        self._resync.set()
        if threading.current_thread() is not self:
            with self._client_lock:
                if self._client is not None:
                    self._client.close()

    def run(self) -> None:
        while not self._stop_event.is_set():
            stream_id, last_seq = (0, 0) if self._resync.is_set() else self._position()
            self._resync.clear()
            failed = False
            try:
                with self._client_lock:
                    self._client = DaemonClient(self.address)
                for batch in watch(self._client, stream_id, last_seq):
                    if self._stop_event.is_set():
                        return
                    self._apply(batch)
                    if self._resync.is_set():
                        break
            except KvtierError:
                pass  # the node went away or restarted: resume (or resync) when it is back
            except Exception as e:
                failed = True
                self._failed(e)
            finally:
                with self._client_lock:
                    if self._client is not None:
                        self._client.close()
                        self._client = None
            if failed or not self._resync.is_set():
                self._stop_event.wait(self.retry_s)

    def _failed(self, e: Exception) -> None:
        self.errors += 1
        self.last_error = e
        _log.error(
            "events: following %s (%s): %s: %s; forgetting its pages, starting over from a "
            "snapshot",
            self.address,
            self.name,
            type(e).__name__,
            e,
            exc_info=e,
        )
        if self._on_error is not None:
            try:
                self._on_error(e)
            except Exception:
                _log.exception("events: following %s: on_error failed", self.address)
        self._resync.set()

    def stop(self) -> None:
        self._stop_event.set()
        with self._client_lock:
            if self._client is not None:
                self._client.close()
        self.join(timeout=5)
