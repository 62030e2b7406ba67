"""kvtier.events against three real kvtierds: the fleet index follows each node's WatchEvents
stream and routes a shared-prefix workload to the node that holds the longest prefix, then
follows a node's restart (a new stream: resync) and an operator's clear."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.events import EventBatch, EventKind, EventTier, FleetIndex, NodeView, PageEvent, watch
from kvtier.host import DaemonClient, HostSession, KvtierError
from kvtier.keys import page_keys
from kvtier.testing import Kvtierd
from kvtier.testing.layouts import tiny_layout
from kvtier.v1 import admin_pb2, common_pb2, host_pb2

PAGE = 4


def layout() -> common_pb2.LayoutDescriptor:
    return tiny_layout(PAGE)


def store(s: HostSession, keys: list[bytes]) -> None:
    r = s.store(keys, lambda i, addr: ctypes.memset(addr, i + 1, s.page_bytes))
    assert r.held == len(keys), r


def until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def nodes(tmp_path: Path):
    ds = [Kvtierd(tmp_path / f"n{i}", "l2.pool_pages=256") for i in range(3)]
    yield ds
    for d in ds:
        d.stop()


def test_the_fleet_index_routes_a_shared_prefix_to_the_node_that_holds_most(nodes) -> None:
    prompt = list(range(1000, 1000 + 8 * PAGE))
    keys = page_keys(prompt, PAGE)
    other = page_keys(list(range(5000, 5000 + 3 * PAGE)), PAGE)
    clients = [DaemonClient(d.socket) for d in nodes]
    sessions = [c.register(f"w{i}", layout()) for i, c in enumerate(clients)]
    # Node 0 computed the first 2 pages of the prompt, node 1 the first 6, node 2 another
    # prompt; node 1 stores its pages from concurrent requests' saves, a page at a time.
    store(sessions[0], keys[:2])
    store(sessions[2], other)
    with FleetIndex() as fleet:
        for i, d in enumerate(nodes):
            fleet.follow(f"n{i}", d.socket)
        for k in keys[:6]:
            store(sessions[1], [k])
        until("node 1's six pages", lambda: fleet.view("n1").held() == 6)
        until("node 0's two pages", lambda: fleet.view("n0").held() == 2)
        until("node 2's pages", lambda: fleet.view("n2").held() == 3)
        assert fleet.locate(keys) == {"n0": 2, "n1": 6, "n2": 0}
        assert fleet.route(keys) == ("n1", 6)
        assert fleet.route(other) == ("n2", 3)
        assert fleet.route(page_keys(list(range(9000, 9000 + PAGE)), PAGE)) is None
        # Pages of another layout do not count for this one.
        fp = next(iter(fleet.view("n1").pages))
        assert fleet.locate(keys, layout=fp)["n1"] == 6
        assert fleet.locate(keys, layout="0" * 32)["n1"] == 0
        # Asking the nodes directly (Locate) gives the same answers as their events.
        assert [c.locate(fp, keys) for c in clients] == [(2, 0), (6, 0), (0, 0)]
        with pytest.raises(KvtierError, match="layout"):
            clients[0].locate("not-hex", keys)

        # Node 1 restarts: a new stream. Its follower resyncs from the new run's snapshot,
        # which holds nothing of the old run's pool (a clean stop gives L2 back).
        sessions[1].close()
        before = fleet.view("n1")
        nodes[1].stop()
        nodes[1].start()
        until(
            "node 1's new stream",
            lambda: fleet.view("n1").stream_id not in (0, before.stream_id),
        )
        until("node 1 empty", lambda: fleet.view("n1").held() == 0)
        assert fleet.view("n1").resyncs > before.resyncs
        assert fleet.route(keys) == ("n0", 2)

        # The operator clears node 0's L2: every page removed, and the route goes.
        admin = DaemonClient(nodes[0].socket)
        r = admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_HOST))
        assert r.removed == 2
        until("node 0 empty", lambda: fleet.view("n0").held() == 0)
        assert fleet.route(keys) is None
        admin.close()
    for s in (sessions[0], sessions[2]):
        s.close()
    for c in clients:
        c.close()


def test_a_resume_replays_and_a_reader_decodes_every_kind(kvtierd) -> None:
    c = DaemonClient(kvtierd.socket)
    s = c.register("w", layout())
    keys = page_keys(list(range(12)), PAGE)
    store(s, keys[:1])
    stream = watch(c)
    first = next(stream)
    assert first.events[0].kind is EventKind.RESYNC and first.node
    view = NodeView()
    view.apply(first)
    store(s, keys[1:])
    while view.held() < 3:
        view.apply(next(stream))
    stream.close()
    held = view.pages[next(iter(view.pages))]
    assert len(held) == len(keys) and all(k in held for k in keys)
    # A resume from the last event applied replays nothing twice and needs no snapshot.
    store(s, page_keys(list(range(100, 104)), PAGE))
    again = next(watch(c, view.stream_id, view.last_seq))
    # (L3's events of the pages written through may come first.)
    l2 = [e.kind for e in again.events if e.tier is EventTier.L2_HOST]
    assert l2 == [EventKind.STORED]
    assert again.events[0].seq == view.last_seq + 1
    s.close()
    c.close()


def test_a_malformed_event_is_an_error_naming_the_field() -> None:
    with pytest.raises(KvtierError, match="kind 9 is not an event kind"):
        PageEvent.of(host_pb2.PageEvent(kind=9))
    with pytest.raises(KvtierError, match="key: a page key is 32 bytes, got 3"):
        PageEvent.of(host_pb2.PageEvent(kind=host_pb2.PAGE_EVENT_KIND_STORED, key=b"abc"))


def test_a_clear_of_one_tenants_pool_names_the_tenant_and_the_view_forgets_the_layout() -> None:
    fp = "d" * 32
    e = PageEvent.of(
        host_pb2.PageEvent(
            seq=3,
            kind=host_pb2.PAGE_EVENT_KIND_CLEARED,
            tier=host_pb2.EVENT_TIER_L2_HOST,
            layout=fp,
            tenant_tag=0xACAC,
        )
    )
    assert e.kind is EventKind.CLEARED and e.tenant_tag == 0xACAC
    v = NodeView()
    stored = PageEvent(1, 0, EventKind.STORED, b"\x01" * 32, None, fp, EventTier.L2_HOST)
    v.apply(EventBatch(1, "n", (stored,)))
    v.apply(EventBatch(1, "n", (e,)))
    assert v.held() == 0 and v.last_seq == 3


def test_a_key_set_agrees_with_a_set_through_splits_and_removals(monkeypatch) -> None:
    import random

    from kvtier.events import KeySet

    monkeypatch.setattr(KeySet, "LEAF", 8)  # many leaves from a few hundred keys
    rng = random.Random(43)
    keys = [rng.randbytes(32) for _ in range(600)]
    model: set[bytes] = set()
    ks = KeySet()
    for step in range(6000):
        k = rng.choice(keys)
        if rng.random() < 0.6:
            ks.add(k)
            model.add(k)
        else:
            ks.discard(k)
            model.discard(k)
        if step % 500 == 0:
            assert len(ks) == len(model)
            assert [k in ks for k in keys] == [k in model for k in keys]
    copy = ks.copy()
    for k in list(model):
        ks.discard(k)
    assert len(ks) == 0 and not any(k in ks for k in keys)
    assert len(copy) == len(model) and all(k in copy for k in model)
    assert b"short" not in copy and 5 not in copy


def test_l3_events_follow_write_through_evictions_and_clears(tmp_path: Path) -> None:
    # A file L3 bounded to 9 pages (328-byte objects): write-through lands every page there
    # (STORED, tier L3), the bound evicts the oldest (REMOVED, tier L3), the operator's
    # clears empty one tier at a time.
    d = Kvtierd(
        tmp_path / "d",
        "l2.pool_pages=256",
        "l3.write_policy=write_through",
        "l3.file.capacity_bytes=3000",
    )
    c = DaemonClient(d.socket)
    s = c.register("w", layout())
    first = page_keys(list(range(100, 100 + 6 * PAGE)), PAGE)
    second = page_keys(list(range(500, 500 + 6 * PAGE)), PAGE)
    admin = DaemonClient(d.socket)
    with FleetIndex() as fleet:
        fleet.follow("n", d.socket)
        store(s, first)
        until("the pages in L3", lambda: fleet.view("n").held(EventTier.L3_STORAGE) == 6)
        assert fleet.locate(first, tier=EventTier.L3_STORAGE) == {"n": 6}
        # L2 cleared: the route by L2 goes, the one by either tier stays (L3 still has them).
        admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_HOST))
        until("L2 empty", lambda: fleet.view("n").held() == 0)
        assert fleet.route(first) is None
        assert fleet.route(first, tier=None) == ("n", 6)
        # Six more pages into a 9-page L3: the oldest leave it, and the index follows.
        store(s, second)
        every = first + second

        def agrees() -> bool:
            v = fleet.view("n")
            held = [any(k in ks for ks in v.storage.values()) for k in every]
            return held == s.lookup_each(every, include_storage=True) and 0 < sum(held) <= 9

        until("the evictions", agrees)
        assert fleet.view("n").held(EventTier.L3_STORAGE) < 12
        # The operator clears L3: the index forgets its L3 pages, not L2's.
        l2_before = fleet.view("n").held()
        admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_STORAGE))
        until("L3 empty", lambda: fleet.view("n").held(EventTier.L3_STORAGE) == 0)
        assert fleet.view("n").held() == l2_before
    admin.close()
    s.close()
    c.close()
    d.stop()


def test_a_node_view_keeps_tiers_apart() -> None:
    k = [bytes([i]) * 32 for i in range(3)]
    fp = "c" * 32

    def ev(kind: EventKind, tier: EventTier, key: bytes = b"", lay: str = fp) -> PageEvent:
        return PageEvent(1, 0, kind, key, None, lay, tier)

    v = NodeView()
    l2, l3 = EventTier.L2_HOST, EventTier.L3_STORAGE
    v.apply(
        EventBatch(
            1,
            "n",
            (
                ev(EventKind.STORED, l2, k[0]),
                ev(EventKind.STORED, l3, k[0]),
                ev(EventKind.STORED, l3, k[1]),
                ev(EventKind.STORED, l2, k[2]),
                ev(EventKind.REMOVED, l2, k[0]),
            ),
        )
    )
    assert (v.prefix(k), v.prefix(k, tier=l3), v.prefix(k, tier=None)) == (0, 2, 3)
    v.apply(EventBatch(1, "n", (ev(EventKind.CLEARED, l3, lay=""),)))
    assert (v.held(), v.held(l3), v.prefix(k, tier=None)) == (1, 0, 0)


def test_a_follower_survives_an_apply_that_raises_and_starts_over(kvtierd) -> None:
    # Anything but a KvtierError raised while applying a batch once killed the follower's
    # thread, freezing the node's view; now it is counted, the view forgotten, and the
    # follower starts over from a snapshot.
    c = DaemonClient(kvtierd.socket)
    s = c.register("w", layout())
    keys = page_keys(list(range(8 * PAGE)), PAGE)
    store(s, keys[:2])
    told: list[int] = []

    def changes(node: str, tier: EventTier, lay: str, tags, held: bool) -> None:
        tags = list(tags)
        if held and len(told) == 3:
            told.append(-1)
            raise RuntimeError("injected")
        told.extend(tags)

    with FleetIndex(changes=changes) as fleet:
        fleet.follow("n", kvtierd.socket, retry_s=0.05)
        until("the first pages", lambda: fleet.view("n").held() == 2)
        store(s, keys[2:])
        until("the error counted", lambda: fleet.errors() == {"n": 1})
        until("every page after the fresh snapshot", lambda: fleet.view("n").held() == 8)
        assert fleet.locate(keys) == {"n": 8}
        store(s, page_keys(list(range(900, 900 + PAGE)), PAGE))
        until("later pages still followed", lambda: fleet.view("n").held() == 9)
        assert fleet.errors() == {"n": 1}
    s.close()
    c.close()


def test_a_node_removed_is_no_longer_followed_and_comes_back_empty(nodes) -> None:
    keys = page_keys(list(range(4 * PAGE)), PAGE)
    c = DaemonClient(nodes[0].socket)
    s = c.register("w", layout())
    store(s, keys[:2])
    with FleetIndex() as fleet:
        fleet.follow("n0", nodes[0].socket)
        fleet.follow("n1", nodes[1].socket)
        until("node 0's pages", lambda: fleet.view("n0").held() == 2)
        follower = fleet._followers["n0"]
        assert fleet.remove("n0") and not fleet.remove("n0")
        assert not follower.is_alive()
        assert fleet.locate(keys) == {"n1": 0}
        store(s, keys[2:])
        time.sleep(0.3)
        assert "n0" not in fleet.locate(keys) and fleet.view("n0").held() == 0
        # Followed again under the same name: from an empty view, then the snapshot.
        fleet.follow("n0", nodes[0].socket)
        until("node 0's pages again", lambda: fleet.view("n0").held() == 4)
        # Following a name already followed replaces its follower.
        old = fleet._followers["n0"]
        fleet.follow("n0", nodes[0].socket)
        assert not old.is_alive()
        until("still followed", lambda: fleet.locate(keys)["n0"] == 4)
    s.close()
    c.close()


def test_a_view_that_fails_part_way_agrees_with_what_it_told() -> None:
    fp = "e" * 32
    ks = [bytes([i]) * 32 for i in range(1, 6)]
    told: set[int] = set()

    def changes(tier: EventTier, lay: str, tags, held: bool) -> None:
        tags = list(tags)
        if held and len(told) == 3:
            raise RuntimeError("injected")
        (told.update if held else told.difference_update)(tags)

    v = NodeView()
    stored = tuple(
        PageEvent(i + 1, 0, EventKind.STORED, k, None, fp, EventTier.L2_HOST)
        for i, k in enumerate(ks)
    )
    with pytest.raises(RuntimeError):
        v.apply(EventBatch(1, "n", stored), changes)
    assert set(v.pages[fp].tags()) == told and len(told) == 3 and v.last_seq == 3
