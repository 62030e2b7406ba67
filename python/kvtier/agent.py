"""A kvtier-agent's engine API from Python (``kvtier.v1.Agent``; proto/kvtier/v1/agent.proto
says the protocol).

The agent is the engine's prefix cache (L1) over the engine's own KV pool: the engine
registers its pool, matches a request's tokens, lends free pages for load-back, inserts
what it computed, releases the request's handle and asks for pages back when it runs short.

An engine that keeps its own prefix cache (vLLM) registers with ``engine_cache=True``
instead: the agent keeps no tree, and the engine asks what L2 and L3 hold of a prompt
(``lookup_pages``), loads those pages into pages it names (``load_pages``) and saves the
pages it computed (``save_pages``). Calls take and return plain Python values; the wire
messages stay inside this module.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier import _memory_door
from kvtier._rpc import KvtierError, grpc_channel, grpc_target
from kvtier._rpc import call as _call
from kvtier.host import POLICIES, Progress, final_progress, namespace_pb
from kvtier.keys import Namespace
from kvtier.tokens import packed
from kvtier.v1 import agent_pb2, agent_pb2_grpc, common_pb2, host_pb2

# The metadata header that presents a registration's owner token (agent.proto).
OWNER_HEADER = "kvtier-pool-owner"
# The metadata header that names a call, so that ``AgentClient.cancel`` can stop it.
CALL_ID_HEADER = "kvtier-call-id"

# Most Saves the agent takes in one SaveBatch (agent.proto); save_batch sends more in parts.
MAX_SAVE_BATCH = 4096


@dataclass(frozen=True)
class After:
    """The tokens of a prompt from a call's start page on, after the key of the page before
    it (``parent``): the call carries and the agent hashes only those pages, not the whole
    prefix. Keys come from :meth:`AgentClient.lookup_pages` (``want_keys``) or
    :func:`kvtier.keys.page_keys`."""

    parent: bytes
    tokens: Sequence[int]


def _prompt(tokens: Sequence[int] | After) -> tuple[bytes, bytes]:
    """(packed_tokens, parent_key) as the wire carries them."""
    if isinstance(tokens, After):
        return packed(tokens.tokens), tokens.parent
    return packed(tokens), b""


@dataclass(frozen=True)
class Match:
    """A request's cached prefix: device pages (locked for ``handle`` until release), then
    how many more pages L2 and, after those, L3 hold."""

    handle: int
    device_pages: list[int]
    l2_pages: int
    l3_pages: int
    total_pages: int

    @staticmethod
    def of(r: agent_pb2.MatchResponse) -> Match:
        return Match(r.handle, list(r.device_pages), r.l2_pages, r.l3_pages, r.total_pages)


@dataclass(frozen=True)
class LoadBack:
    """Pages loaded into the first lent pages; the handle's device prefix now; lent pages
    the engine gets back unused."""

    loaded: int
    device_pages: list[int]
    unused_pages: list[int]


@dataclass(frozen=True)
class Inserted:
    """Pages inserted, and the engine's pages that duplicate the tree's (the engine frees
    them)."""

    inserted: int
    duplicate_pages: list[int]


@dataclass(frozen=True)
class Evicted:
    """Device pages now free; of them, how many are in L2 and how many were given up."""

    pages: list[int]
    backed_up: int
    lost: int


@dataclass(frozen=True)
class Lookup:
    """Of a prompt's ``total_pages`` full pages, after the engine's own: how many L2 holds,
    then how many after those L3 holds; and, under a write policy that selects pages, how
    many leading pages it selects now (None: it saves every page). Pass ``save_pages`` to
    every worker's save (``selected``) so that all TP ranks save the same pages."""

    l2_pages: int
    l3_pages: int
    total_pages: int
    save_pages: int | None = None
    # Under want_keys: the keys of the pages the lookup's tokens cover (from page 0, or from
    # its start page under a parent key), 32 bytes each, back to back.
    packed_keys: bytes = b""

    def keys(self) -> list[bytes]:
        k = self.packed_keys
        return [k[i : i + 32] for i in range(0, len(k), 32)]


@dataclass(frozen=True)
class Loaded:
    """A Load: how many leading pages hold their page (the rest the engine computes), and
    the key of the last page it asked for, loaded or not (b"" when it asked for none): the
    parent of a Load of the pages after it (``After(last_key, ...)``), which saves the
    engine hashing them."""

    pages: int
    last_key: bytes = b""


@dataclass(frozen=True)
class Saved:
    """A save's pages: copied into L2, already there, below write_through_selective's
    threshold, not saved (L2 refused or unreachable; counted by the agent)."""

    stored: int
    present: int
    skipped: int
    failed: int


@dataclass(frozen=True)
class SaveItem:
    """One Save of :meth:`AgentClient.save_batch`: as :meth:`AgentClient.save_pages`'s
    arguments."""

    tokens: Sequence[int] | After
    namespace: Namespace
    start_page: int
    device_pages: Sequence[int]
    selected: int | None = None

    def request(self) -> agent_pb2.SavePagesRequest:
        toks, parent = _prompt(self.tokens)
        req = agent_pb2.SavePagesRequest(
            packed_tokens=toks,
            namespace=namespace_pb(self.namespace),
            start_page=self.start_page,
            device_pages=self.device_pages,
            parent_key=parent,
        )
        if self.selected is not None:
            req.selected = self.selected
        return req


@dataclass(frozen=True)
class PagePiece:
    """``length`` bytes of every page of a CUDA pool: page p's at allocation ``allocation`` +
    ``offset`` + p × ``page_stride``. A page's pieces, in order, are its bytes in a host
    slot."""

    allocation: int
    offset: int
    page_stride: int
    length: int


@dataclass(frozen=True)
class PoolInfo:
    """What the agent derived from the registered pool."""

    layout: common_pb2.LayoutInfo
    num_pages: int
    daemon_connected: bool
    # The registration's owner token: a call may present it explicitly (``owner=``) so that
    # it is refused, rather than served against another pool, once the pool is registered
    # again.
    owner: str = ""


def _socket_address(target: str) -> str | tuple[str, int] | None:
    """The socket a gRPC ``target`` (as ``grpc_target`` makes it) connects to: a Unix
    socket's path, or (host, port); None for a form without both (a name to resolve
    through an authority, no port)."""
    if target.startswith("unix:"):
        return target.removeprefix("unix:").removeprefix("//")
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target.removeprefix(scheme)
            if target.startswith("//"):
                # dns://[authority]/host:port
                target = target[2:].partition("/")[2]
            break
    host, colon, port = target.rpartition(":")
    if not colon or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


class AgentClient:
    """A channel to one kvtier-agent (its socket path, or ``host:port``)."""

    def __init__(self, address: str, timeout: float = 5.0):
        self.address, self.timeout = address, timeout
        self.channel = grpc_channel(address)
        self.stub = agent_pb2_grpc.AgentStub(self.channel)
        # The owner token of this client's registration, presented on every call after it.
        self._owner: list[tuple[str, str]] = []

    def forget_registration(self) -> None:
        """Stops presenting the owner token: later calls are refused until a new
        registration (the agent must not serve them against the pool registered before)."""
        self._owner = []

    def _call(
        self,
        fn,
        request,
        timeout: float | None = None,
        owner: str | None = None,
        call_id: str | None = None,
    ):
        meta = self._owner if owner is None else [(OWNER_HEADER, owner)]
        if call_id is not None:
            meta = [*meta, (CALL_ID_HEADER, call_id)]
        # Every NOT_FOUND an agent answers is of the caller's pool (one older than the
        # kvtier-lost trailer says so by its code alone).
        return _call(fn, request, timeout or self.timeout, meta, bare_not_found="pool")

    def listening(self, timeout: float = 1.0) -> bool:
        """Whether a process listens at the agent's address (a connection is accepted, even
        by an agent too stopped to answer it). False: the agent that served calls there is
        gone, and no copy of its can still move. An address it cannot tell counts as
        listening (the caller keeps asking rather than assume the agent gone)."""
        where = _socket_address(grpc_target(self.address))
        try:
            if where is None:
                return True
            if isinstance(where, str):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(timeout)
                    s.connect(where)
            else:
                socket.create_connection(where, timeout).close()
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            # Anything else (a timeout, a full backlog): something is there.
            return True
        return True

    def cancel(
        self, call_ids: Sequence[str], owner: str | None = None, timeout: float | None = None
    ) -> int:
        """Stops this client's calls named ``call_ids`` (each sent with ``call_id=``) before
        their deadline: returns once no part of their copies is still moving, so the pages
        lent to them are the engine's again; how many were running. A call that reaches the
        agent after its Cancel copies nothing. A ``KvtierError`` (``retryable``) when a copy
        did not stop within 2 s: then the pages are not free until a Cancel answers."""
        req = agent_pb2.CancelRequest(call_ids=list(call_ids))
        return self._call(self.stub.Cancel, req, timeout, owner).cancelled

    def register_pool(
        self,
        layout: common_pb2.LayoutDescriptor,
        num_token_slots: int,
        cpu_fd: int | None = None,
        cuda_ordinal: int | None = None,
        cuda_ipc_handles: Sequence[bytes] = (),
        engine_cache: bool = False,
        allocation_bytes: Sequence[int] = (),
        pieces: Sequence[PagePiece] = (),
        cpu_allocation_fds: Sequence[int] = (),
    ) -> PoolInfo:
        """Registers the engine's KV pool, one of three ways:

        - ``cpu_fd``: the descriptor of a CPU shared-memory file (a memfd: see
          :func:`kvtier._memory_door.memfd`) of layer-first buffers;
        - ``cpu_allocation_fds``: the engine's own CPU allocations, by descriptor, that the
          agent reads and writes in place, with ``allocation_bytes`` and ``pieces``;
        - ``cuda_ordinal`` with ``cuda_ipc_handles``: one handle per buffer, or (with
          ``pieces``) one per allocation, ``allocation_bytes`` long.

        CPU memory goes to the agent as descriptors, deposited at its memory door (the agent
        opens no path a client names); the caller keeps its own. ``pieces`` place a page's
        bytes (in their order in a host slot) in the allocations. ``engine_cache``: the
        engine keeps its own prefix cache (see the module doc)."""
        req = agent_pb2.RegisterPoolRequest(
            layout=layout, num_token_slots=num_token_slots, engine_cache=engine_cache
        )
        cpu = cpu_fd is not None or bool(cpu_allocation_fds)
        if cpu == (cuda_ordinal is not None) or (cpu_fd is not None and cpu_allocation_fds):
            raise ValueError(
                "register_pool: give exactly one of cpu_fd, cpu_allocation_fds and cuda_ordinal"
            )
        wire = [
            agent_pb2.PagePiece(
                allocation=p.allocation,
                offset=p.offset,
                page_stride=p.page_stride,
                length=p.length,
            )
            for p in pieces
        ]
        if cpu:
            fds = [cpu_fd] if cpu_fd is not None else list(cpu_allocation_fds)
            ticket = _memory_door.deposit(self.stats().memory_socket, fds, self.timeout)
            req.cpu.CopyFrom(
                agent_pb2.CpuPool(
                    memory=ticket,
                    allocation_bytes=list(allocation_bytes),
                    pieces=wire,
                )
            )
        else:
            req.cuda.CopyFrom(
                agent_pb2.CudaPool(
                    device_ordinal=cuda_ordinal,
                    ipc_handles=list(cuda_ipc_handles),
                    allocation_bytes=list(allocation_bytes),
                    pieces=wire,
                )
            )
        r = self._call(self.stub.RegisterPool, req)
        self._owner = [(OWNER_HEADER, r.owner)]
        return PoolInfo(r.layout, r.num_pages, r.daemon_connected, r.owner)

    def match(self, tokens: Sequence[int], namespace: Namespace = Namespace()) -> Match:
        req = agent_pb2.MatchRequest(
            packed_tokens=packed(tokens), namespace=namespace_pb(namespace)
        )
        return Match.of(self._call(self.stub.Match, req))

    def match_batch(self, requests: Sequence[tuple[Sequence[int], Namespace]]) -> list[Match]:
        req = agent_pb2.MatchBatchRequest(
            requests=[
                agent_pb2.MatchRequest(packed_tokens=packed(t), namespace=namespace_pb(ns))
                for t, ns in requests
            ]
        )
        r = self._call(self.stub.MatchBatch, req)
        return [Match.of(m) for m in r.responses]

    def load_back(self, handle: int, free_pages: Sequence[int]) -> LoadBack:
        req = agent_pb2.LoadBackRequest(handle=handle, free_pages=free_pages)
        r = self._call(self.stub.LoadBack, req)
        return LoadBack(r.loaded, list(r.device_pages), list(r.unused_pages))

    def prefetch(
        self,
        handle: int,
        policy: str = "wait_complete",
        timeout_ms: int = 0,
        timeout: float | None = None,
    ) -> Progress:
        """Loads the handle's L3 pages into L2 and waits for the prefetch's final state; a
        later load_back takes what landed."""
        if policy not in POLICIES:
            raise ValueError(f"prefetch policy {policy!r} is not one of {', '.join(POLICIES)}")
        req = agent_pb2.AgentPrefetchRequest(
            handle=handle,
            policy=POLICIES[policy],
            hints=host_pb2.PrefetchHints(timeout_ms=timeout_ms),
        )
        return final_progress(self.stub.Prefetch, req, timeout or self.timeout, self._owner)

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        namespace: Namespace = Namespace(),
    ) -> Inserted:
        req = agent_pb2.InsertRequest(
            packed_tokens=packed(tokens),
            device_pages=device_pages,
            namespace=namespace_pb(namespace),
        )
        r = self._call(self.stub.Insert, req)
        return Inserted(r.inserted, list(r.duplicate_pages))

    def release(self, handle: int) -> None:
        self._call(self.stub.Release, agent_pb2.AgentReleaseRequest(handle=handle))

    def release_batch(self, handles: Sequence[int]) -> None:
        self._call(self.stub.ReleaseBatch, agent_pb2.ReleaseBatchRequest(handles=handles))

    def evict(self, pages: int) -> Evicted:
        r = self._call(self.stub.Evict, agent_pb2.EvictRequest(pages=pages))
        return Evicted(list(r.pages), r.backed_up, r.lost)

    def lookup_pages(
        self,
        tokens: Sequence[int] | After,
        namespace: Namespace = Namespace(),
        start_page: int = 0,
        want_keys: bool = False,
        timeout: float | None = None,
    ) -> Lookup:
        """Engine-cache mode: what L2 and L3 hold of the prompt after its first
        ``start_page`` pages (the engine's own). ``tokens``: the whole prompt, or
        :class:`After` a parent key from ``start_page`` on. ``want_keys``: also return the
        keys of the pages ``tokens`` cover. ``timeout``: this call's deadline (None: the
        client's)."""
        toks, parent = _prompt(tokens)
        req = agent_pb2.PagesLookupRequest(
            packed_tokens=toks,
            namespace=namespace_pb(namespace),
            start_page=start_page,
            parent_key=parent,
            want_keys=want_keys,
        )
        r = self._call(self.stub.Lookup, req, timeout)
        selected = r.save_pages if r.HasField("save_pages") else None
        return Lookup(r.l2_pages, r.l3_pages, r.total_pages, selected, r.packed_keys)

    def load_pages(
        self,
        tokens: Sequence[int] | After,
        namespace: Namespace,
        start_page: int,
        device_pages: Sequence[int],
        policy: str | None = None,
        timeout_ms: int = 0,
        timeout: float | None = None,
        owner: str | None = None,
        call_id: str | None = None,
        whole_load_pages: int = 0,
    ) -> Loaded:
        """Engine-cache mode: loads pages ``start_page..`` of the prompt into
        ``device_pages`` in order; returns how many leading ones hold their page (the rest
        the engine computes) and the last one's key. ``policy``: how to wait for pages from
        L3 (None: the daemon's). ``owner``: present this registration's token
        (PoolInfo.owner) rather than the client's latest. ``call_id``: names the call for
        :meth:`cancel` (unique among this client's calls). ``whole_load_pages``: where this
        call loads one piece of a larger load, that load's pages (kvtierd's
        load-versus-recompute decision weighs the whole load, so every piece gets its
        answer)."""
        toks, parent = _prompt(tokens)
        req = agent_pb2.LoadPagesRequest(
            packed_tokens=toks,
            namespace=namespace_pb(namespace),
            start_page=start_page,
            device_pages=device_pages,
            hints=host_pb2.PrefetchHints(timeout_ms=timeout_ms, whole_load_pages=whole_load_pages),
            parent_key=parent,
        )
        if policy is not None:
            if policy not in POLICIES:
                raise ValueError(f"prefetch policy {policy!r} is not one of {', '.join(POLICIES)}")
            req.policy = POLICIES[policy]
        r = self._call(self.stub.Load, req, timeout, owner, call_id)
        return Loaded(r.loaded, r.last_key)

    def save_pages(
        self,
        tokens: Sequence[int] | After,
        namespace: Namespace,
        start_page: int,
        device_pages: Sequence[int],
        timeout: float | None = None,
        selected: int | None = None,
        owner: str | None = None,
        call_id: str | None = None,
    ) -> Saved:
        """Engine-cache mode: saves the computed pages ``start_page..`` of the prompt, held
        in ``device_pages``, into L2 per the agent's write policy (or per ``selected``, a
        lookup's ``save_pages``: pages before it are saved). On return the agent reads none
        of the pages any more."""
        req = SaveItem(tokens, namespace, start_page, device_pages, selected).request()
        r = self._call(self.stub.Save, req, timeout, owner, call_id)
        return Saved(r.stored, r.present, r.skipped, r.failed)

    def save_batch(
        self,
        items: Sequence[SaveItem],
        timeout: float | None = None,
        owner: str | None = None,
        call_id: str | None = None,
    ) -> list[Saved]:
        """Several Saves in one call (an engine step's new pages for all its requests), in
        the order given. Every item is checked before any page moves: a malformed one
        refuses the call (``KvtierError.invalid_input``, naming ``requests[i]``). More
        items than the agent takes in one call (``MAX_SAVE_BATCH``) go in several, in
        order, each under ``call_id`` (a cancel stops the part running and every later
        one)."""
        out: list[Saved] = []
        for at in range(0, len(items), MAX_SAVE_BATCH):
            part = items[at : at + MAX_SAVE_BATCH]
            req = agent_pb2.SaveBatchRequest(requests=[i.request() for i in part])
            r = self._call(self.stub.SaveBatch, req, timeout, owner, call_id)
            if len(r.responses) != len(part):
                raise KvtierError(
                    f"SaveBatch: the agent answered {len(r.responses)} of {len(part)} Saves"
                )
            out += [Saved(x.stored, x.present, x.skipped, x.failed) for x in r.responses]
        return out

    def stats(self) -> agent_pb2.AgentStatsResponse:
        return self._call(self.stub.AgentStats, agent_pb2.AgentStatsRequest())

    def close(self) -> None:
        self.channel.close()
