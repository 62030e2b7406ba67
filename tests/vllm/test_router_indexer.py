"""A real router's indexer reads kvtier's events: NVIDIA Dynamo's KV-router radix tree (PyPI
``ai-dynamo-runtime``, ``dynamo.llm.RadixTree``) is fed, per node, what the ZMQ bridge
(``kvtier.integrations.vllm.kv_events``) publishes, and its overlap answers (matched blocks per
worker) must equal what the nodes say themselves (``Locate``) and what ``kvtier.events.FleetIndex``
says, for seeded random prompts with shared prefixes on three kvtierds, through evictions, an
operator's clear and a node's restart.

Dynamo's own ZMQ listener (``python -m dynamo.indexer``, ``zmq_wire::convert_event``) cannot
take the bridge's stream as it is: it reads block hashes as 64-bit integers (a 32-byte page key
fails the whole batch: "data did not match any variant of untagged enum BlockHashValue"), and it
computes each block's match hash from ``token_ids``, which kvtierd never sees ("Block not
published. token_ids too short"). So this test does that listener's last step itself, the way
it does it (a ``KvCacheEvent`` per vLLM event, applied to the worker's radix tree), with the one
difference the missing tokens force: each block's match hash (``tokens_hash``, Dynamo's
``LocalBlockHash``) is the page key itself, cut to Dynamo's 64 bits, as is its
``block_hash`` (``ExternalSequenceBlockHash``, what removals and parents name). A router queries
with the same cut of the keys ``kvtier.keys`` computes for the prompt (Dynamo's
``/query_by_hash`` takes match hashes the same way). Everything else is Dynamo's: inserting
under the parent found through the worker's own blocks, removal, clearing a worker, and the
overlap walk that scores each worker.

The wire is read as a router reads it: a SUB socket, a DEALER asking the replay socket for
what it missed, every payload decoded with vLLM's own ``KVEventBatch`` decoder."""

from __future__ import annotations

import ctypes
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
import zmq
from dynamo.llm import RadixTree
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvtier.events import FleetIndex
from kvtier.host import DaemonClient, HostSession
from kvtier.integrations.vllm.kv_events import END_SEQ, KvEventsBridge
from kvtier.keys import page_keys
from kvtier.testing import Kvtierd
from kvtier.testing.layouts import tiny_layout
from kvtier.v1 import admin_pb2, common_pb2

PAGE = 4
POOL = 48  # pages of L2 per node: the random stores overflow it, so pages are evicted
NODES = 3


def layout() -> common_pb2.LayoutDescriptor:
    return tiny_layout(PAGE)


def store(s: HostSession, keys: Sequence[bytes]) -> None:
    """A prompt's pages from its first, as an engine saves them: the pages the node already
    holds are kept (PRESENT), the others written after them, each the parent of the next."""
    r = s.store(keys, lambda i, addr: ctypes.memset(addr, i + 1, s.page_bytes))
    assert r.held == len(keys), r


def h64(key: object) -> int:
    """A page key as Dynamo's 64-bit block hash: its last 8 bytes (under tenancy the first 8
    are the tenant's tag; ``FleetIndex`` keeps the same 64 bits)."""
    assert isinstance(key, bytes) and len(key) == 32, key
    return int.from_bytes(key[24:], "big")


def to_dynamo(event: object, event_id: int) -> dict[str, object]:
    """One vLLM event from the bridge as Dynamo's ``KvCacheEvent`` (its serde JSON form, what
    ``RadixTree.apply_event`` reads), as Dynamo's ``convert_event`` builds it from an engine's
    event but with the page key as the match hash (no tokens to hash)."""
    if isinstance(event, BlockStored):
        assert event.token_ids == [] and event.block_size == PAGE, event
        assert event.medium == MEDIUM_CPU, event  # L2; no L3 here
        parent, keys = event.parent_block_hash, event.block_hashes
        assert parent is None or isinstance(parent, bytes), parent
        assert all(isinstance(k, bytes) for k in keys), keys
        data: object = {
            "stored": {
                "parent_hash": h64(parent) if parent else None,
                "blocks": [{"block_hash": h64(k), "tokens_hash": h64(k)} for k in keys],
            }
        }
    elif isinstance(event, BlockRemoved):
        assert event.medium == MEDIUM_CPU, event
        data = {"removed": {"block_hashes": [h64(k) for k in event.block_hashes]}}
    else:
        assert isinstance(event, AllBlocksCleared), event
        data = "cleared"
    return {"event_id": event_id, "data": data, "dp_rank": 0}


class DynamoFeed:
    """One node's bridge read as a router reads it (live messages, replays on a gap), each
    event applied to Dynamo's radix tree as worker ``worker``."""

    def __init__(self, bridge: KvEventsBridge, tree: RadixTree, worker: int):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(bridge.endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        assert bridge.replay_endpoint is not None
        self.replay.connect(bridge.replay_endpoint)
        self.decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.tree, self.worker = tree, worker
        self.next_seq = 0
        self.event_id = 0
        self.applied: Counter[str] = Counter()

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (a replay overlapping the live stream)
        assert seq == self.next_seq, f"hole: got {seq}, expected {self.next_seq}"
        self.next_seq += 1
        for e in self.decode(payload).events:
            ev = to_dynamo(e, self.event_id)
            self.event_id += 1
            self.tree.apply_event(self.worker, json.dumps(ev).encode())
            self.applied[type(e).__name__] += 1

    def catch_up(self) -> None:
        """Asks the replay socket for everything from the next wanted batch."""
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            _, _topic, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self._apply(int.from_bytes(seq, "big"), payload)

    def poll(self) -> None:
        while self.sub.poll(5):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.next_seq:
                self.catch_up()
            self._apply(seq, payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def prompts(rng: random.Random, n: int) -> list[list[bytes]]:
    """``n`` prompts' page keys: a few shared system prompts (roots) of several pages, each
    prompt one of them cut at a random page, then pages of its own."""
    roots = [[rng.randrange(50_000) for _ in range(6 * PAGE)] for _ in range(4)]
    out = []
    for _ in range(n):
        root = rng.choice(roots)[: rng.randrange(0, 7) * PAGE]
        own = [rng.randrange(50_000) for _ in range(rng.randrange(1, 7) * PAGE)]
        out.append(page_keys(root + own, PAGE))
    return out


@pytest.fixture
def nodes(tmp_path: Path):
    ds = [
        Kvtierd(tmp_path / f"n{i}", f"l2.pool_pages={POOL}", "l3.backend=none")
        for i in range(NODES)
    ]
    yield ds
    for d in ds:
        d.stop()


def test_dynamos_radix_tree_fed_by_the_bridge_agrees_with_locate_and_the_fleet_index(
    nodes: list[Kvtierd],
) -> None:
    rng = random.Random(64)
    workload = prompts(rng, 40)
    # Prompts no node is given: every answer must be empty for them.
    unseen = prompts(random.Random(65), 5)
    clients = [DaemonClient(d.socket) for d in nodes]
    sessions = [c.register(f"w{i}", layout()) for i, c in enumerate(clients)]
    tree = RadixTree()
    bridges = [
        KvEventsBridge(
            d.socket,
            "tcp://127.0.0.1:0",
            "tcp://127.0.0.1:0",
            block_size=PAGE,
            replays_per_s=1000,
        )
        for d in nodes
    ]
    feeds = [DynamoFeed(b, tree, i) for i, b in enumerate(bridges)]
    fleet = FleetIndex()
    for i, d in enumerate(nodes):
        fleet.follow(f"n{i}", d.socket)
    fp: list[str] = []

    def dynamo(keys: list[bytes]) -> dict[int, int]:
        scores = tree.find_matches([h64(k) for k in keys]).scores
        return {worker: n for (worker, _dp), n in scores.items() if n}

    def located(keys: list[bytes]) -> dict[int, int]:
        got = {i: c.locate(fp[0], keys)[0] for i, c in enumerate(clients)}
        return {i: n for i, n in got.items() if n}

    def fleet_says(keys: list[bytes]) -> dict[int, int]:
        return {int(name[1:]): n for name, n in fleet.locate(keys).items() if n}

    def agree(what: str, timeout: float = 15.0) -> int:
        """Waits until Dynamo's answers and the fleet index's equal Locate's for every
        prompt (kvtierd's own, the truth), and returns how many prompts some node holds."""
        end = time.monotonic() + timeout
        for f in feeds:
            f.catch_up()
        while True:
            for f in feeds:
                f.poll()
            diffs = []
            for keys in workload + unseen:
                truth = located(keys)
                d, fl = dynamo(keys), fleet_says(keys)
                if d != truth or fl != truth:
                    diffs.append((len(keys), truth, d, fl))
            if not diffs:
                return sum(bool(located(k)) for k in workload)
            assert time.monotonic() < end, (
                f"{what}: {len(diffs)} prompts differ; (pages, Locate, Dynamo, FleetIndex): "
                f"{diffs[:5]}"
            )
            time.sleep(0.02)

    def store_randomly(count: int) -> None:
        for _ in range(count):
            i = rng.randrange(NODES)
            keys = rng.choice(workload)
            store(sessions[i], keys[: rng.randrange(1, len(keys) + 1)])

    try:
        store(sessions[0], workload[0])
        end = time.monotonic() + 10
        while not fleet.view("n0").pages:
            assert time.monotonic() < end, "the fleet index saw no page"
            time.sleep(0.02)
        fp.append(next(iter(fleet.view("n0").pages)))
        # Rounds of prompts stored on random nodes, to random depths: shared roots, a prompt
        # on several nodes at different lengths, and pools overflowing (evictions).
        for r in range(6):
            store_randomly(15)
            held = agree(f"round {r}")
            assert held > 0
        assert all(f.applied["BlockStored"] > 0 for f in feeds)
        assert all(f.applied["BlockRemoved"] > 0 for f in feeds), "no node evicted a page"
        # Some prompt is held by several nodes at different lengths (what routing weighs).
        assert any(len(set(located(k).values())) > 1 for k in workload)
        # An operator clears node 1's L2: a BlockRemoved for each page.
        admin = DaemonClient(nodes[1].socket)
        admin.admin.Clear(admin_pb2.ClearRequest(tier=common_pb2.TIER_HOST))
        admin.close()
        agree("node 1's clear")
        assert all(1 not in dynamo(k) for k in workload)
        # Node 2 restarts: its stream starts over (AllBlocksCleared, then the new run's
        # snapshot: empty, as a clean stop gives L2 back), and Dynamo drops what it held.
        before = feeds[2].applied["AllBlocksCleared"]
        assert any(2 in dynamo(k) for k in workload), "node 2 held nothing before its restart"
        sessions[2].close()
        clients[2].close()
        nodes[2].stop()
        nodes[2].start()
        clients[2] = DaemonClient(nodes[2].socket)
        sessions[2] = clients[2].register("w2-again", layout())
        agree("node 2's restart")
        assert feeds[2].applied["AllBlocksCleared"] > before
        assert all(2 not in dynamo(k) for k in workload)
        # And the fleet goes on: every node stores again, node 2 from empty.
        for r in range(3):
            store_randomly(15)
            agree(f"after the restart, round {r}")
        assert any(2 in dynamo(k) for k in workload)
    finally:
        fleet.close()
        for f in feeds:
            f.close()
        for b in bridges:
            b.close()
        for s in sessions:
            s.close()
        for c in clients:
            c.close()


def test_the_conversion_matches_dynamos_own_reading_of_a_prompt_tree() -> None:
    """``to_dynamo`` on its own against Dynamo's radix tree: a chain, a branch off it on
    another worker, a removal in the middle (the worker's prefix stops there) and a clear."""
    k = [bytes([i]) * 32 for i in range(8)]
    tree = RadixTree()

    def apply(worker: int, *events: object) -> None:
        for i, e in enumerate(events):
            tree.apply_event(worker, json.dumps(to_dynamo(e, i)).encode())

    def stored(keys: list[bytes], parent: bytes | None = None) -> BlockStored:
        return BlockStored(
            block_hashes=list(keys),
            parent_block_hash=parent,
            token_ids=[],
            block_size=PAGE,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
        )

    def scores(keys: list[bytes]) -> dict[int, int]:
        found = tree.find_matches([h64(x) for x in keys]).scores
        return {w: n for (w, _), n in found.items()}

    apply(1, stored(k[:4]))
    apply(2, stored(k[:2]), stored([k[5], k[6]], k[1]))
    assert scores(k[:4]) == {1: 4, 2: 2}
    assert scores([*k[:2], k[5], k[6]]) == {1: 2, 2: 4}
    apply(1, BlockRemoved(block_hashes=[k[1]], medium=MEDIUM_CPU))
    assert scores(k[:4]) == {1: 1, 2: 2}
    apply(2, AllBlocksCleared())
    assert scores([*k[:2], k[5], k[6]]) == {1: 1}


def test_a_page_stored_before_its_parent_is_where_dynamo_counts_fewer(tmp_path: Path) -> None:
    """The one difference found: kvtierd keeps a page whose parent it does not hold yet (a
    save whose earlier pages found no room, or came later), and counts it once the parent
    comes. Dynamo's radix tree drops a stored block whose parent the worker does not hold
    ("Failed to find parent block; skipping store operation") and never links it later, so
    it counts fewer leading blocks for that node than ``Locate`` and ``FleetIndex`` do: a
    router on it undervalues the node, never sends a request where pages are missing."""
    d = Kvtierd(tmp_path / "d", "l2.pool_pages=64", "l3.backend=none")
    client = DaemonClient(d.socket)
    s = client.register("w", layout())
    keys = page_keys(list(range(100, 100 + 4 * PAGE)), PAGE)
    tree = RadixTree()
    bridge = KvEventsBridge(
        d.socket,
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        block_size=PAGE,
        replays_per_s=1000,
    )
    feed = DynamoFeed(bridge, tree, 0)
    fleet = FleetIndex()
    fleet.follow("n0", d.socket)
    fill = lambda i, addr: ctypes.memset(addr, i + 1, s.page_bytes)  # noqa: E731
    try:
        # The bridge follows the node's stream before the pages come (a snapshot would list
        # them parents first).
        end = time.monotonic() + 10
        while bridge.published == 0:
            assert time.monotonic() < end, "the bridge published nothing"
            time.sleep(0.01)
        assert s.store(keys[:1], fill).held == 1
        assert s.store(keys[2:], fill, parent=keys[1]).held == 2  # before page 1
        assert s.store(keys[1:2], fill, parent=keys[0]).held == 1
        feed.catch_up()
        while feed.applied["BlockStored"] < 3 or fleet.view("n0").held() < 4:
            assert time.monotonic() < end, "timed out waiting for the events"
            feed.poll()
        fp = next(iter(fleet.view("n0").pages))
        assert client.locate(fp, keys) == (4, 0)
        assert fleet.locate(keys) == {"n0": 4}
        assert tree.find_matches([h64(k) for k in keys]).scores == {(0, 0): 2}
    finally:
        fleet.close()
        feed.close()
        bridge.close()
        s.close()
        client.close()
        d.stop()
