"""kvtier.routing: each policy's decisions against a brute-force oracle over seeded random
fleets and prompts, what events change, and bad input refused."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvtier.events import EventBatch, EventKind, EventTier, PageEvent
from kvtier.routing import Policy, Router, _Table

L2, L3 = EventTier.L2_HOST, EventTier.L3_STORAGE
STORED, REMOVED, CLEARED, RESYNC = (
    EventKind.STORED,
    EventKind.REMOVED,
    EventKind.CLEARED,
    EventKind.RESYNC,
)
LAYOUT = "ab" * 16
OTHER = "cd" * 16


def ev(kind: EventKind, key: bytes = b"", tier: EventTier = L2, layout: str = LAYOUT):
    return PageEvent(0, 0, kind, key, None, layout, tier)


def batch(node: str, *events: PageEvent) -> EventBatch:
    return EventBatch(1, node, tuple(events))


def keys(n: int, seed: int) -> list[bytes]:
    return [random.Random(seed * 1_000_003 + i).randbytes(32) for i in range(n)]


@dataclass
class Model:
    """What each node holds, kept from the raw events with plain sets (the oracle's side)."""

    held: dict[str, dict[tuple[EventTier, str], set[bytes]]] = field(default_factory=dict)

    def apply(self, node: str, b: EventBatch) -> None:
        sets = self.held.setdefault(node, {})
        for e in b.events:
            if e.kind is STORED:
                sets.setdefault((e.tier, e.layout), set()).add(e.key)
            elif e.kind is REMOVED:
                sets.get((e.tier, e.layout), set()).discard(e.key)
            elif e.kind is CLEARED:
                for tier, layout in list(sets):
                    if tier is e.tier and (not e.layout or layout == e.layout):
                        del sets[tier, layout]
            else:
                sets.clear()

    def scores(
        self, r: Router, ks: Sequence[bytes], layout: str, queue: Sequence[float]
    ) -> list[tuple[int, int, float]]:
        """(l2, h, score) per node of ``r.nodes``, each counted page by page."""
        in_l3 = set().union(*(s.get((L3, layout), set()) for s in self.held.values()))
        out = []
        for i, name in enumerate(r.nodes):
            mine = self.held.get(name, {}).get((L2, layout), set())
            l2 = next((j for j, k in enumerate(ks) if k not in mine), len(ks))
            h = next((j for j, k in enumerate(ks) if k not in mine and k not in in_l3), len(ks))
            score = r.page_tokens * (l2 + r.l3_weight * (h - l2)) - r.load_weight * queue[i]
            out.append((l2, h, score))
        return out

    def choice(self, r: Router, ks: Sequence[bytes], layout: str, queue: Sequence[float]):
        s = self.scores(r, ks, layout, queue)
        best = max(range(len(s)), key=lambda i: (s[i][2], -i))  # the first of equal ones
        return best, s[best]


def random_fleet(seed: int, nodes: int, steps: int = 60, router: Router | None = None):
    """A fleet of ``nodes`` fed random events over shared prompts: system prompts many nodes
    hold, users' continuations a few do, L3 writes, evictions, clears and resyncs."""
    rng = random.Random(seed)
    r = router or Router(Policy.KVTIER, l3_weight=rng.choice([0.0, 0.5, 0.8, 1.0]))
    m = Model()
    systems = [keys(rng.randint(1, 12), seed * 100 + i) for i in range(3)]
    prompts = [
        systems[rng.randrange(3)] + keys(rng.randint(0, 20), seed * 100 + 10 + u) for u in range(8)
    ]
    names = [f"node-{i}" for i in range(nodes)]
    for n in names:
        r.add(n)
    for _ in range(steps):
        node = rng.choice(names)
        events = []
        for _ in range(rng.randint(1, 12)):
            p = rng.choice(prompts)
            cut = rng.randint(0, len(p))
            layout = LAYOUT if rng.random() < 0.9 else OTHER
            tier = L3 if rng.random() < 0.3 else L2
            roll = rng.random()
            if roll < 0.55:  # a prompt's leading pages stored
                events += [ev(STORED, k, tier, layout) for k in p[:cut]]
            elif roll < 0.85:  # evictions
                events += [ev(REMOVED, k, tier, layout) for k in rng.sample(p, min(3, len(p)))]
            elif roll < 0.92:
                events.append(ev(CLEARED, tier=tier, layout=rng.choice([layout, ""])))
            elif roll < 0.96:  # a restart: every layout cleared, then what it took over
                events.append(ev(CLEARED, tier=L2, layout=""))
                events += [ev(STORED, k) for k in p[: cut // 2]]
            else:  # a resync and its snapshot
                events.append(ev(RESYNC, layout=""))
                events += [ev(STORED, k) for k in p[:cut]]
                events += [ev(STORED, k, L3) for k in p[: cut // 2]]
        b = batch(node, *events)
        r.apply(node, b)
        m.apply(node, b)
    return r, m, prompts, rng


@pytest.mark.parametrize("seed", range(40))
def test_kvtier_choice_is_the_oracles_argmax(seed: int):
    r, m, prompts, rng = random_fleet(seed, nodes=1 + seed % 9)
    for _ in range(30):
        p = rng.choice(prompts)
        ks = p[: rng.randint(0, len(p))] + keys(rng.randint(0, 3), 9_000 + seed)
        queue = [float(rng.choice([0, 0, 16, 50, 400])) for _ in r.nodes]
        layout = LAYOUT if rng.random() < 0.85 else OTHER
        d = r.choose(ks, layout, queue)
        best, (l2, h, score) = m.choice(r, ks, layout, queue)
        assert d is not None
        assert (d.index, d.node, d.l2_pages, d.l3_pages) == (best, r.nodes[best], l2, h - l2)
        assert d.score == pytest.approx(score)
        want = {
            n: (a, b - a) for n, (a, b, _) in zip(r.nodes, m.scores(r, ks, layout, queue)) if b > 0
        }
        assert r.prefixes(ks, layout) == want


@pytest.mark.parametrize("seed", range(4))
def test_kvtier_choice_at_hundreds_of_nodes(seed: int):
    # Holder sets of more than 16 nodes take the bitset's other path.
    r, m, prompts, rng = random_fleet(seed, nodes=300, steps=400)
    for _ in range(20):
        ks = rng.choice(prompts)
        queue = [float(rng.randrange(0, 64)) for _ in r.nodes]
        d = r.choose(ks, LAYOUT, queue)
        best, (l2, h, _) = m.choice(r, ks, LAYOUT, queue)
        assert d is not None and (d.index, d.l2_pages, d.l3_pages) == (best, l2, h - l2)


def test_removed_and_cleared_change_the_answer():
    p = keys(10, 1)
    r = Router("kvtier", ["a", "b"])
    r.apply("a", batch("a", *(ev(STORED, k) for k in p)))
    r.apply("b", batch("b", *(ev(STORED, k) for k in p[:6])))
    d = r.choose(p, LAYOUT)
    assert d is not None and (d.node, d.l2_pages) == ("a", 10)
    r.apply("a", batch("a", ev(REMOVED, p[3])))
    d = r.choose(p, LAYOUT)
    assert d is not None and (d.node, d.l2_pages) == ("b", 6)
    r.apply("b", batch("b", ev(CLEARED, layout=LAYOUT)))
    d = r.choose(p, LAYOUT)
    assert d is not None and (d.node, d.l2_pages) == ("a", 3)
    r.apply("a", batch("a", ev(CLEARED, layout="")))
    d = r.choose(p, LAYOUT, {"a": 5.0})
    assert d is not None and (d.node, d.l2_pages, d.l3_pages) == ("b", 0, 0)
    assert r.prefixes(p, LAYOUT) == {}


def test_a_node_that_resyncs_is_scored_by_what_it_holds_after():
    p, q = keys(8, 2), keys(8, 3)
    r = Router("kvtier", ["a", "b"])
    r.apply("a", batch("a", *(ev(STORED, k) for k in p)))
    r.apply("b", batch("b", *(ev(STORED, k) for k in p[:4])))
    # a restarts: a new stream's CLEARED of every layout, then what it took over (another
    # prompt); then b is told to resync, and its snapshot holds p whole.
    r.apply("a", batch("a", ev(CLEARED, layout=""), *(ev(STORED, k) for k in q)))
    assert r.prefixes(p, LAYOUT) == {"b": (4, 0)}
    assert r.prefixes(q, LAYOUT) == {"a": (8, 0)}
    r.apply("b", batch("b", ev(RESYNC, layout=""), *(ev(STORED, k) for k in p)))
    d = r.choose(p, LAYOUT, [0.0, 100.0])
    assert d is not None and (d.node, d.l2_pages) == ("b", 8)
    assert r.prefixes(p, LAYOUT) == {"b": (8, 0)}


def test_l3_extends_every_nodes_run_and_load_weighs_against_it():
    p = keys(12, 4)
    r = Router("kvtier", ["a", "b", "c"], page_tokens=16, l3_weight=0.5)
    r.apply("a", batch("a", *(ev(STORED, k) for k in p[:4])))
    # b wrote pages 4.. to the shared L3: a can load them after its own 4; c, which holds
    # nothing, cannot (page 0 is in no L3).
    r.apply("b", batch("b", *(ev(STORED, k, L3) for k in p[4:])))
    assert r.prefixes(p, LAYOUT) == {"a": (4, 8)}
    d = r.choose(p, LAYOUT)
    assert d is not None and (d.node, d.l2_pages, d.l3_pages) == ("a", 4, 8)
    assert d.score == 16 * (4 + 0.5 * 8)
    # a's queue past what its pages save: the least loaded other node.
    d = r.choose(p, LAYOUT, [16 * 8 + 3.0, 3.0, 2.0])
    assert d is not None and d.node == "c"
    # Page 0 in L3 too: every node's run is L3's.
    r.apply("b", batch("b", *(ev(STORED, k, L3) for k in p[:4])))
    assert r.prefixes(p, LAYOUT) == {"a": (4, 8), "b": (0, 12), "c": (0, 12)}


@pytest.mark.parametrize("seed", range(5))
def test_round_robin_and_random_against_their_oracles(seed: int):
    names = [f"n{i}" for i in range(1 + seed * 3)]
    rr = Router("round_robin", names)
    rnd = Router(Policy.RANDOM, names, seed=seed)
    oracle = random.Random(seed)
    for i in range(50):
        d = rr.choose(keys(2, i), LAYOUT)
        assert d is not None and (d.index, d.node) == (i % len(names), names[i % len(names)])
        d = rnd.choose([], LAYOUT)
        assert d is not None and d.index == oracle.randrange(len(names))


def ring_oracle(names: Sequence[str], ks: Sequence[bytes], r: Router) -> str:
    import hashlib

    def point(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")

    ring = sorted((point(f"{n}#{j}".encode()), n) for n in names for j in range(r.ring_points))
    h = point(b"".join(ks[: r.hash_pages]))
    return next((n for p, n in ring if p >= h), ring[0][1])


@pytest.mark.parametrize("seed", range(5))
def test_prefix_hash_against_its_oracle(seed: int):
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(2 + seed * 4)]
    r = Router("prefix_hash", names, hash_pages=3, ring_points=1 + seed * 20)
    prompts = [keys(rng.randint(0, 8), seed * 500 + i) for i in range(200)]
    before = {}
    for i, p in enumerate(prompts):
        d = r.choose(p, LAYOUT)
        assert d is not None and d.node == ring_oracle(names, p, r)
        # Only the first hash_pages pages count.
        d2 = r.choose(p + keys(3, 77), LAYOUT)
        assert d2 is not None and (len(p) < 3 or d2.node == d.node)
        before[i] = d.node
    # A node added takes some prompts; none moves between the others.
    r.add("new")
    for i, p in enumerate(prompts):
        d = r.choose(p, LAYOUT)
        assert d is not None and d.node == ring_oracle([*names, "new"], p, r)
        assert d.node in (before[i], "new")
    # Removed again, it gives back exactly the prompts it took.
    r.remove("new")
    for i, p in enumerate(prompts):
        d = r.choose(p, LAYOUT)
        assert d is not None and (d.node, d.index) == (before[i], names.index(before[i]))


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="policy 'kv-tier' is not one of round_robin, random"):
        Policy.parse("kv-tier")
    with pytest.raises(ValueError, match="policy 'KVTIER'"):
        Router("KVTIER")
    assert Policy.parse("prefix_hash") is Policy.PREFIX_HASH
    for kw in ({"page_tokens": 0}, {"l3_weight": 1.5}, {"load_weight": -1.0}, {"hash_pages": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Router("kvtier", **kw)  # type: ignore[arg-type]
    r = Router("kvtier", ["a", "b"])
    with pytest.raises(ValueError, match=r"keys\[1\]: a page key is 32 bytes, got 5"):
        r.choose([b"x" * 32, b"short"], LAYOUT)
    with pytest.raises(ValueError, match="queue: 2 nodes"):
        r.choose(keys(2, 0), LAYOUT, [1.0, 2.0, 3.0])
    assert Router("kvtier").choose(keys(2, 0), LAYOUT) is None


@pytest.mark.parametrize("seed", range(6))
def test_the_index_table_against_a_dict(seed: int):
    # Growth from a tiny table, back-shifting deletes, tag 0.
    rng = random.Random(seed)
    t, d = _Table(bits=2), {}
    universe = [0, 1, 2**64 - 1] + [rng.getrandbits(64) for _ in range(3000)]
    for step in range(20_000):
        k = rng.choice(universe[: 50 + step // 4])
        v = rng.choice([0, 0, rng.randrange(1, 1 << 40)])
        t.put(k, v)
        if v:
            d[k] = v
        else:
            d.pop(k, None)
        assert t.size == len(d)
    for k in universe:
        assert t.get(k) == d.get(k, 0)
    import numpy as np

    probe = np.array(universe, dtype=np.uint64)
    assert t.lookup(probe).tolist() == [d.get(k, 0) for k in universe]


def tag_key(t: int) -> bytes:
    """A page key whose tag (last 8 bytes, little-endian) is ``t``: what a peer that sends
    chosen keys in its events can make."""
    return b"\x11" * 24 + t.to_bytes(8, "little")


def longest_run(t: _Table) -> int:
    """The longest run of occupied slots: the most a probe of ``t`` can walk."""
    import numpy as np

    full = np.concatenate(([0], (t.keys != 0).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(full))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


@pytest.mark.parametrize("where", ["high", "top44"])
def test_chosen_tags_neither_break_nor_pile_up_in_the_index(where: str):
    # Tags near 2**64 once ran probes off the table's end (IndexError mid-batch); tags
    # sharing their top bits made one run as long as they were many (quadratic inserts).
    if where == "high":
        tags = [(1 << 64) - 1 - i for i in range(4200)]
    else:
        tags = [(0x123456789AB << 20) | i for i in range(6000)]
    ks = [tag_key(t) for t in tags]
    r = Router("kvtier", ["a", "b"])
    m = Model()
    b = batch("b", *(ev(STORED, k) for k in ks))
    r.apply("b", b)
    m.apply("b", b)
    table = r._pages[LAYOUT]
    assert table.size == len(ks)
    assert longest_run(table) < 200
    assert r.prefixes(ks[:2048], LAYOUT) == {"b": (2048, 0)}
    d = r.choose(ks[:2048], LAYOUT, [0.0, 10.0])
    assert d is not None and (d.node, d.l2_pages) == ("b", 2048)
    # Removing them all shifts back through whatever runs there are.
    r.apply("b", batch("b", *(ev(REMOVED, k) for k in ks[::2])))
    m.apply("b", batch("b", *(ev(REMOVED, k) for k in ks[::2])))
    assert r.prefixes(ks[1:3], LAYOUT) == {"b": (1, 0)}
    assert r.prefixes(ks[:2], LAYOUT) == {}


def test_two_tables_place_the_same_tags_differently():
    # The slot comes from a keyed mix drawn per table: one peer's chosen tags cannot be
    # aimed at another router's runs.
    import numpy as np

    tags = np.arange(1, 200, dtype=np.uint64)
    a, b = _Table(), _Table()
    assert (a.mix_many(tags) != b.mix_many(tags)).any()
    assert [a.mix(int(t)) for t in tags] == a.mix_many(tags).tolist()


def agrees_with_its_views(r: Router, ks: Sequence[bytes]) -> None:
    """The index's runs equal what the fleet's views hold, page by page."""
    l2 = r.fleet.locate(ks, LAYOUT)
    got = r.prefixes(ks, LAYOUT)
    for name in r.nodes:
        assert got.get(name, (0, 0))[0] == l2.get(name, 0), name


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_a_batch_whose_index_change_fails_leaves_view_and_index_agreeing(monkeypatch, fail_at):
    p = keys(12, 11)
    r = Router("kvtier", ["a", "b"])
    r.apply("a", batch("a", *(ev(STORED, k) for k in p[:6])))
    budget = fail_at  # puts that succeed before one fails (once; then all do)
    real_set = _Table.set

    def flaky_set(self: _Table, m: int, i: int, old: int, v: int) -> None:
        nonlocal budget
        budget -= 1
        if budget == -1:
            raise MemoryError("injected")
        real_set(self, m, i, old, v)

    monkeypatch.setattr(_Table, "set", flaky_set)
    with pytest.raises(MemoryError, match="injected"):
        r.apply("b", batch("b", *(ev(STORED, k) for k in p)))
    agrees_with_its_views(r, p)
    assert r.prefixes(p, LAYOUT).get("b", (0, 0))[0] == fail_at
    # A clear that fails part way through its pages leaves them all held, and told.
    budget = min(fail_at, 5)
    with pytest.raises(MemoryError):
        r.apply("a", batch("a", ev(CLEARED, layout="")))
    agrees_with_its_views(r, p)
    assert r.prefixes(p, LAYOUT)["a"] == (6, 0)
    monkeypatch.setattr(_Table, "set", real_set)
    r.apply("b", batch("b", *(ev(STORED, k) for k in p)))
    r.apply("a", batch("a", ev(CLEARED, layout="")))
    assert r.prefixes(p, LAYOUT) == {"b": (12, 0)}


@pytest.mark.parametrize(
    "kw",
    [
        {"load_weight": float("inf")},
        {"load_weight": float("nan")},
        {"l3_weight": float("nan")},
        {"l3_weight": "0.5"},
        {"page_tokens": float("inf")},
        {"page_tokens": 1.5},
        {"page_tokens": True},
        {"page_tokens": "16"},
        {"page_tokens": 1 << 40},
        {"hash_pages": float("inf")},
        {"hash_pages": 2.0},
        {"ring_points": 10**7},
        {"ring_points": False},
        {"seed": float("nan")},
        {"seed": True},
    ],
)
def test_every_parameter_is_checked_for_type_and_finite_bounds(kw):
    with pytest.raises(ValueError, match=f"routing: {next(iter(kw))}: "):
        Router("kvtier", ["a"], **kw)


@pytest.mark.parametrize("policy", [p.value for p in Policy])
def test_a_queue_is_finite_not_negative_of_the_nodes_known_under_every_policy(policy: str):
    import numpy as np

    r = Router(policy, ["a", "b", "c"])
    p = keys(4, 5)
    r.apply("b", batch("b", *(ev(STORED, k) for k in p)))
    for q, what in [
        ([0.0, float("nan"), 0.0], r"queue\[1\]: nan is not finite"),
        ([float("nan"), 0.0, 0.0], r"queue\[0\]: nan"),
        ([0.0, -1e9, 0.0], r"queue\[1\]: -1000000000.0 is not finite and ≥ 0"),
        ([float("-inf"), 0.0, 0.0], r"queue\[0\]: -inf"),
        ([float("inf")] * 3, r"queue\[0\]: inf"),
        ({"a": float("nan")}, r"queue\['a'\]: nan"),
        ({"zzz": 5.0}, r"queue: 'zzz' is not a node"),
        ({"a": "5"}, r"queue\['a'\]: '5' is not a number"),
        ({"a": None}, r"queue\['a'\]: None is not a number"),
        ([[0.0, 0.0, 0.0]], r"queue: 3 nodes, got \(1, 3\)"),
        (np.zeros((3, 1)), r"queue: 3 nodes, got \(3, 1\)"),
        ([0.0, 0.0], r"queue: 3 nodes, got \(2,\)"),
        ([0.0, 0.0, 0.0, 0.0, 0.0], r"queue: 3 nodes, got \(5,\)"),
        ("abc", r"queue: 'abc' is not a sequence of numbers"),
        ([None, 0.0, 0.0], "queue: numbers are wanted"),
        ([True, False, False], "queue: numbers are wanted"),
    ]:
        with pytest.raises(ValueError, match=what):
            r.choose(p, LAYOUT, q)  # type: ignore[arg-type]
    for ok in ([0, 5, 0], np.array([0.0, 1.0, 2.0]), {"b": 3}, None, [-0.0, 0.0, 0.0]):
        assert r.choose(p, LAYOUT, ok) is not None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys\[0\]: a page key is bytes"):
        Router("kvtier", ["a"]).choose(["a" * 32], LAYOUT)  # type: ignore[list-item]


def test_a_layouts_table_goes_when_no_node_holds_its_pages_and_shrinks_when_emptied():
    r = Router("kvtier", ["n"])
    layouts = [f"{i:032x}" for i in range(300)]
    for lay in layouts:
        r.apply("n", batch("n", ev(STORED, keys(1, 7)[0], layout=lay)))
    assert len(r._pages) == 300
    r.apply("n", batch("n", ev(CLEARED, layout="")))
    assert r._pages == {} and r.fleet.view("n").pages == {}
    # One page removed by REMOVED: its layout goes from the view and from the index.
    k = keys(1, 8)[0]
    r.apply("n", batch("n", ev(STORED, k, L3, layout=OTHER)))
    r.apply("n", batch("n", ev(REMOVED, k, L3, layout=OTHER)))
    assert r._pages == {} and r.fleet.view("n").storage == {}
    # A big layout mostly evicted shrinks to about its size; emptied, it goes.
    p = keys(20_000, 9)
    r.apply("n", batch("n", *(ev(STORED, k) for k in p)))
    big = len(r._pages[LAYOUT].keys)
    assert big >= 2 * 20_000
    r.apply("n", batch("n", *(ev(REMOVED, k) for k in p[100:])))
    t = r._pages[LAYOUT]
    assert t.size == 100 and len(t.keys) <= 4 * 128 + 64
    assert r.prefixes(p, LAYOUT) == {"n": (100, 0)}
    r.apply("n", batch("n", ev(RESYNC)))
    assert r._pages == {}


def test_a_node_removed_stops_counting_and_comes_back_empty():
    p = keys(10, 12)
    r = Router("kvtier", ["a", "b", "c"])
    r.apply("a", batch("a", *(ev(STORED, k) for k in p[:3])))
    r.apply("b", batch("b", *(ev(STORED, k) for k in p), *(ev(STORED, k, L3) for k in p)))
    d = r.choose(p, LAYOUT)
    assert d is not None and (d.node, d.l2_pages) == ("b", 10)
    assert r.remove("b") and not r.remove("b") and not r.remove("zzz")
    # Its L2 and its L3 pages are forgotten; the nodes after it move down a place, and
    # queues follow the new order.
    assert r.nodes == ("a", "c")
    assert r.prefixes(p, LAYOUT) == {"a": (3, 0)}
    d = r.choose(p, LAYOUT, [100.0, 0.0])
    assert d is not None and (d.node, d.index) == ("c", 1)
    with pytest.raises(ValueError, match="queue: 3 nodes|queue: 2 nodes"):
        r.choose(p, LAYOUT, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="'b' is not a node"):
        r.choose(p, LAYOUT, {"b": 1.0})
    assert r.fleet.locate(p, LAYOUT) == {"a": 3}
    # Back under its old name: an empty view, in the place it left.
    assert r.add("b") == 1 and r.nodes == ("a", "b", "c")
    assert r.fleet.view("b").held() == 0 and r.prefixes(p, LAYOUT) == {"a": (3, 0)}
    r.apply("b", batch("b", *(ev(STORED, k) for k in p[:1])))
    assert r.prefixes(p, LAYOUT) == {"a": (3, 0), "b": (1, 0)}
    # Churned names do not pile up.
    for i in range(50):
        r.apply(f"t{i}", batch(f"t{i}", ev(STORED, p[0])))
        r.remove(f"t{i}")
    assert r.nodes == ("a", "b", "c") and len(r._names) == 3
    assert r.prefixes(p[:1], LAYOUT) == {"a": (1, 0), "b": (1, 0)}


@pytest.mark.parametrize("seed", range(12))
def test_kvtier_choice_is_the_oracles_argmax_through_removals(seed: int):
    r, m, prompts, rng = random_fleet(seed, nodes=2 + seed % 7)
    for step in range(40):
        if rng.random() < 0.3:
            name = rng.choice(r.nodes)
            r.remove(name)
            m.held.pop(name, None)
            if rng.random() < 0.5:
                r.add(rng.choice([name, f"new-{step}"]))
        elif rng.random() < 0.5:
            name = rng.choice(r.nodes)
            b = batch(name, *(ev(STORED, k, rng.choice([L2, L3])) for k in rng.choice(prompts)))
            r.apply(name, b)
            m.apply(name, b)
        if not r.nodes:
            r.add("x")
        p = rng.choice(prompts)
        queue = [float(rng.choice([0, 16, 400])) for _ in r.nodes]
        d = r.choose(p, LAYOUT, queue)
        best, (l2, h, _) = m.choice(r, p, LAYOUT, queue)
        assert d is not None
        assert (d.index, d.node, d.l2_pages, d.l3_pages) == (best, r.nodes[best], l2, h - l2)
