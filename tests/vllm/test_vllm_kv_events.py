"""kvtierd's page events on ZMQ in vLLM's KV-event format (``kvtier.integrations.vllm.kv_events``),
read the way a router that indexes vLLM's events reads them: a SUB socket, a DEALER asking the
replay socket for what it missed, and every payload decoded with vLLM's own ``KVEventBatch``
decoder from PyPI. Nothing here imitates vLLM's classes."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvtier.events import EventBatch, EventKind, EventTier, PageEvent
from kvtier.host import DaemonClient, HostSession
from kvtier.integrations.vllm.kv_events import END_SEQ, Curve, KvEventsBridge, translate
from kvtier.keys import page_keys
from kvtier.testing import Kvtierd
from kvtier.testing.layouts import tiny_layout
from kvtier.v1 import admin_pb2, common_pb2

PAGE = 4
POOL = 16


def layout() -> common_pb2.LayoutDescriptor:
    return tiny_layout(PAGE)


def store(s: HostSession, keys: list[bytes], parent: bytes = b"") -> None:
    r = s.store(keys, lambda i, addr: ctypes.memset(addr, i + 1, s.page_bytes), parent)
    assert r.held == len(keys), r


class Router:
    """A subscriber as routers write them: live messages from the PUB socket, and on a gap
    (or at the start) the missing ones from the replay socket; it keeps the index vLLM's
    events describe (block hash → parent) and checks the sequence has no holes."""

    def __init__(self, bridge: KvEventsBridge):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(bridge.endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        assert bridge.replay_endpoint is not None
        self.replay.connect(bridge.replay_endpoint)
        self.decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.next_seq = 0
        self.blocks: dict[bytes, bytes | None] = {}  # CPU (kvtierd's L2)
        self.storage: dict[bytes, bytes | None] = {}  # STORAGE (its L3)
        self.events: list[object] = []
        self.replayed = 0

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (a replay overlapping the live stream)
        assert seq == self.next_seq, f"hole: got {seq}, expected {self.next_seq}"
        self.next_seq += 1
        batch = self.decode(payload)
        assert batch.ts > 0 and batch.data_parallel_rank is None
        for e in batch.events:
            self.events.append(e)
            if isinstance(e, BlockStored):
                assert e.block_size == PAGE, e
                assert e.token_ids == [] and e.lora_id is None, e
                held = self._medium(e.medium)
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    assert isinstance(h, bytes) and len(h) == 32, h
                    held[h] = parent
                    parent = h
            elif isinstance(e, BlockRemoved):
                held = self._medium(e.medium)
                for h in e.block_hashes:
                    if e.medium == MEDIUM_CPU:
                        assert h in held, "removed a block never stored"
                    held.pop(h, None)
            else:
                assert isinstance(e, AllBlocksCleared), e
                self.blocks.clear()
                self.storage.clear()

    def _medium(self, medium: str | None) -> dict[bytes, bytes | None]:
        assert medium in (MEDIUM_CPU, MEDIUM_STORAGE), medium
        return self.blocks if medium == MEDIUM_CPU else self.storage

    def _ask_replay(self) -> None:
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            _, _topic, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self.replayed += 1
            self._apply(int.from_bytes(seq, "big"), payload)

    def poll(self) -> None:
        while self.sub.poll(20):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.next_seq:
                self._ask_replay()
            self._apply(seq, payload)

    def until(self, what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        self._ask_replay()
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            self.poll()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


@pytest.fixture
def daemon(tmp_path: Path):
    d = Kvtierd(tmp_path / "d", f"l2.pool_pages={POOL}", "l3.backend=none")
    yield d
    d.stop()


def test_a_router_rebuilds_what_l2_holds_from_the_bridge_with_vllms_decoder(daemon) -> None:
    client = DaemonClient(daemon.socket)
    s = client.register("writer", layout())
    prompt = page_keys(list(range(100, 100 + 6 * PAGE)), PAGE)
    store(s, prompt[:2])
    with KvEventsBridge(
        str(daemon.socket), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=PAGE
    ) as bridge:
        # Subscribed after the first batch went out: it comes from the replay socket.
        end = time.monotonic() + 10
        while bridge.published == 0:
            assert time.monotonic() < end, "nothing published"
            time.sleep(0.01)
        router = Router(bridge)
        try:
            # What L2 held before the bridge came: a clear, then the snapshot.
            router.until("the snapshot", lambda: len(router.blocks) == 2)
            assert isinstance(router.events[0], AllBlocksCleared)
            assert router.replayed > 0, "the first batches come from the replay socket"
            # A prompt's pages continue the first two: one BlockStored per run of a chain,
            # linked to the page before.
            store(s, prompt[2:], parent=prompt[1])
            router.until("the prompt", lambda: len(router.blocks) == 6)
            assert list(router.blocks) == prompt
            assert [router.blocks[k] for k in prompt] == [None, *prompt[:-1]]
            stored = [e for e in router.events if isinstance(e, BlockStored)]
            assert stored[-1].parent_block_hash in prompt[:2]
            # A second prompt larger than what is left evicts the first's leaves (no L3):
            # BlockRemoved, and the router's index is what kvtierd holds.
            other = page_keys(list(range(9000, 9000 + POOL * PAGE)), PAGE)
            for i in range(0, POOL, 4):
                store(s, other[i : i + 4], parent=other[i - 1] if i else b"")
            router.until(
                "the evictions", lambda: any(isinstance(e, BlockRemoved) for e in router.events)
            )
            every = prompt + other

            def agrees() -> bool:
                return [k in router.blocks for k in every] == s.lookup_each(every)

            router.until("the index to agree with L2", agrees)
            assert 0 < sum(k in router.blocks for k in every) <= POOL
            # An operator's clear removes every page: BlockRemoved for each.
            admin = DaemonClient(daemon.socket)
            admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_HOST))
            admin.close()
            router.until("the clear", lambda: not router.blocks)
            # A restart is a new stream: the router hears AllBlocksCleared, then the new
            # run's snapshot (empty: a clean stop gives L2 back).
            store(s, prompt[:3])
            router.until("the new pages", lambda: len(router.blocks) == 3)
            n = len(router.events)
            s.close()
            daemon.stop()
            daemon.start()
            router.until(
                "the restart",
                lambda: any(isinstance(e, AllBlocksCleared) for e in router.events[n:]),
            )
            assert not router.blocks
            client.close()
            client = DaemonClient(daemon.socket)
            s = client.register("writer-2", layout())
            store(s, prompt[:1])
            router.until("a page of the new run", lambda: list(router.blocks) == prompt[:1])
        finally:
            router.close()
    s.close()
    client.close()


def test_runs_merge_and_a_layout_filter_keeps_only_its_pages() -> None:
    """``translate`` on its own, decoded with vLLM's classes: a chain's pages share one
    BlockStored, a page that does not continue the run starts another, removals merge, and
    with a layout set another layout's pages and clears are left out."""
    a, b = "a" * 32, "b" * 32
    k = [bytes([i]) * 32 for i in range(6)]

    def ev(
        kind: EventKind,
        key: bytes = b"",
        parent: bytes | None = None,
        lay: str = a,
        tier: EventTier = EventTier.L2_HOST,
    ):
        return PageEvent(1, 1, kind, key, parent, lay, tier)

    batch = EventBatch(
        7,
        "n",
        (
            ev(EventKind.RESYNC, lay=""),
            ev(EventKind.STORED, k[0]),
            ev(EventKind.STORED, k[1], k[0]),
            ev(EventKind.STORED, k[2], k[1]),
            ev(EventKind.STORED, k[4], k[3]),
            ev(EventKind.STORED, k[5], None, b),
            ev(EventKind.REMOVED, k[2]),
            ev(EventKind.REMOVED, k[1]),
            ev(EventKind.CLEARED, lay=b),
            ev(EventKind.STORED, k[2], k[1], tier=EventTier.L3_STORAGE),
        ),
    )
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode

    def as_vllm(layout_filter: str | None) -> list[object]:
        payload = msgspec.msgpack.encode([1.0, translate(batch, PAGE, layout_filter), None])
        return list(decode(payload).events)

    got = as_vllm(a)
    kinds = [AllBlocksCleared, BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert [type(e) for e in got] == kinds
    first, second, removed, stored_l3 = got[1], got[2], got[3], got[4]
    # L3's pages carry vLLM's STORAGE medium.
    assert isinstance(stored_l3, BlockStored) and stored_l3.medium == MEDIUM_STORAGE
    assert stored_l3.block_hashes == [k[2]] and stored_l3.parent_block_hash == k[1]
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.block_hashes, first.parent_block_hash) == (k[:3], None)
    assert (second.block_hashes, second.parent_block_hash) == ([k[4]], k[3])
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [k[2], k[1]]
    # Without a filter: layout b's page and its clear too.
    got = as_vllm(None)
    assert [type(e) for e in got][-2] is AllBlocksCleared
    assert any(isinstance(e, BlockStored) and e.block_hashes == [k[5]] for e in got)


def test_l3_pages_carry_storage_and_an_l3_clear_gives_back_what_l2_holds(tmp_path) -> None:
    """With a file L3 written through, pages come twice: CPU (L2) and STORAGE (L3). vLLM's
    AllBlocksCleared names no medium, so after the operator clears L3 the bridge has kvtierd
    send a snapshot, and the router gets L2's pages back."""
    d = Kvtierd(tmp_path / "d", "l2.pool_pages=64", "l3.write_policy=write_through")
    client = DaemonClient(d.socket)
    s = client.register("writer", layout())
    prompt = page_keys(list(range(700, 700 + 6 * PAGE)), PAGE)
    with KvEventsBridge(
        str(d.socket), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=PAGE
    ) as bridge:
        router = Router(bridge)
        try:
            store(s, prompt)
            router.until(
                "both tiers",
                lambda: list(router.blocks) == prompt and set(router.storage) == set(prompt),
            )
            n = len(router.events)
            admin = DaemonClient(d.socket)
            admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_STORAGE))
            admin.close()
            router.until(
                "L2's pages after the clear",
                lambda: (
                    any(isinstance(e, AllBlocksCleared) for e in router.events[n:])
                    and list(router.blocks) == prompt
                ),
            )
            cleared = max(i for i, e in enumerate(router.events) if isinstance(e, AllBlocksCleared))
            stored_after = [e for e in router.events[cleared:] if isinstance(e, BlockStored)]
            assert any(e.medium == MEDIUM_CPU for e in stored_after)
        finally:
            router.close()
    s.close()
    client.close()
    d.stop()


def test_the_bridge_refuses_bad_settings_by_name(daemon) -> None:
    with pytest.raises(ValueError, match="block_size"):
        KvEventsBridge(str(daemon.socket), "tcp://127.0.0.1:0", block_size=0)
    with pytest.raises(ValueError, match="^endpoint: cannot bind 'bogus'"):
        KvEventsBridge(str(daemon.socket), "bogus", block_size=PAGE)
    with KvEventsBridge(str(daemon.socket), "tcp://127.0.0.1:0", block_size=PAGE) as taken:
        with pytest.raises(ValueError, match="^replay_endpoint: cannot bind"):
            KvEventsBridge(str(daemon.socket), "tcp://127.0.0.1:0", taken.endpoint, block_size=PAGE)


def test_an_endpoint_other_hosts_reach_needs_curve_or_saying_so(daemon, tmp_path) -> None:
    """Issue 62: run as docs/routing.md showed, the bridge bound ``tcp://*`` with no
    authentication, and an unauthenticated subscriber got every page key of a tenant. An
    address other hosts reach is refused now, naming what would allow it."""
    sock = str(daemon.socket)
    for ep in ("tcp://*:0", "tcp://0.0.0.0:0", "tcp://eth0:0"):
        with pytest.raises(ValueError, match="^endpoint: .*open_endpoints"):
            KvEventsBridge(sock, ep, block_size=PAGE)
    with pytest.raises(ValueError, match="^replay_endpoint: .*open_endpoints"):
        KvEventsBridge(sock, "tcp://127.0.0.1:0", "tcp://*:0", block_size=PAGE)
    with KvEventsBridge(sock, "tcp://*:0", block_size=PAGE, open_endpoints=True) as b:
        assert b.endpoint.startswith("tcp://")
    # Review finding: CURVE without subscribers' keys admits any key (libzmq without an
    # authenticator): not enough for an open address.
    _, secret = zmq.curve_keypair()
    with pytest.raises(ValueError, match="curve_clients"):
        KvEventsBridge(sock, "tcp://0.0.0.0:0", block_size=PAGE, curve=Curve(secret))
    with KvEventsBridge(sock, f"ipc://{tmp_path}/events", block_size=PAGE) as b:
        assert b.endpoint.startswith("ipc://")


def test_with_curve_only_the_listed_subscribers_hear_anything(daemon) -> None:
    client = DaemonClient(daemon.socket)
    s = client.register("writer", layout())
    server_public, server_secret = zmq.curve_keypair()
    ok_public, ok_secret = zmq.curve_keypair()
    other_public, other_secret = zmq.curve_keypair()
    ctx = zmq.Context.instance()
    curve = Curve(server_secret, (ok_public,))
    with KvEventsBridge(str(daemon.socket), "tcp://0.0.0.0:0", block_size=PAGE, curve=curve) as b:
        endpoint = b.endpoint.replace("0.0.0.0", "127.0.0.1")

        def subscriber(public: bytes | None, secret: bytes | None) -> zmq.Socket[bytes]:
            sub = ctx.socket(zmq.SUB)
            if public is not None and secret is not None:
                sub.curve_serverkey = server_public
                sub.curve_publickey = public
                sub.curve_secretkey = secret
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            return sub

        subs = {
            "listed": subscriber(ok_public, ok_secret),
            "unlisted": subscriber(other_public, other_secret),
            "plain": subscriber(None, None),
        }
        try:
            time.sleep(0.5)  # the handshakes
            heard = dict.fromkeys(subs, False)
            for i in range(20):
                store(s, page_keys(list(range(1000 * i, 1000 * i + PAGE)), PAGE))
                for name, sub in subs.items():
                    heard[name] = heard[name] or bool(sub.poll(100))
                if heard["listed"]:
                    break
            assert heard == {"listed": True, "unlisted": False, "plain": False}, heard
        finally:
            for sub in subs.values():
                sub.close(linger=0)
    client.close()


def test_a_replay_flood_is_refused_past_its_rate(daemon) -> None:
    """Issue 62: replays were served on the publishing thread from an unbounded queue, and a
    flood of them pushed a live subscriber's lag from 6 ms to seconds. Replays have a thread
    of their own now, and past ``replays_per_s`` a request gets the end marker alone."""
    with KvEventsBridge(
        str(daemon.socket), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=PAGE,
        replays_per_s=2,
    ) as bridge:  # fmt: skip
        assert bridge.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(bridge.replay_endpoint)
        try:
            for _ in range(20):
                dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            ends = 0
            while ends < 20:
                assert dealer.poll(5000), "no answer from the replay socket"
                if dealer.recv_multipart()[2] == END_SEQ:
                    ends += 1
            assert bridge.replays_refused >= 15, bridge.replays_refused
        finally:
            dealer.close(linger=0)


def test_a_publisher_that_falls_behind_drops_to_a_snapshot_and_never_stalls_the_stream(
    daemon,
) -> None:
    """Batches wait for the publisher in a bounded queue: past it the bridge drops them and
    starts its subscribers over from a snapshot, so what they rebuild is still what L2
    holds."""
    gate = threading.Event()

    class Stalled(KvEventsBridge):
        def _publish_loop(self) -> None:
            gate.wait()
            super()._publish_loop()

    client = DaemonClient(daemon.socket)
    s = client.register("writer", layout())
    prompts = [page_keys(list(range(500 * i, 500 * i + PAGE)), PAGE) for i in range(1, 7)]
    with Stalled(
        str(daemon.socket), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", block_size=PAGE,
        queue_batches=2,
    ) as bridge:  # fmt: skip
        for p in prompts:
            store(s, p)
            time.sleep(0.05)  # a batch each
        end = time.monotonic() + 10
        while bridge.dropped == 0:
            assert time.monotonic() < end, "nothing was dropped"
            time.sleep(0.05)
        gate.set()
        router = Router(bridge)
        try:
            want = {k for p in prompts for k in p}
            router.until("L2's pages", lambda: set(router.blocks) == want)
        finally:
            router.close()
    client.close()
