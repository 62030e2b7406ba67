"""Choosing a node for a request: a :class:`Router` with a :class:`Policy`, fed the fleet's
page events (:mod:`kvtier.events`) and told each node's queue by its caller (docs/routing.md,
"Routing at fleet scale").

Policies:

- ``round_robin``: the nodes in turn.
- ``random``: a node drawn at random (seeded).
- ``prefix_hash``: consistent hashing of the prompt's first pages' keys: the same leading
  pages go to the same node, and adding a node moves only the prompts it takes.
- ``kvtier``: the node that would start the request soonest, counting the prefill its pages
  save against the prefill already queued there. For a prompt of page keys ``k₀ … kₚ₋₁``
  and node ``n``:

  - ``l2(n)``: leading pages ``n``'s L2 holds;
  - ``h(n)``: leading pages each held by ``n``'s L2 or by L3, where L3 is what every node
    reports of the shared storage tier (a page any node's L3 events hold, every node can
    load); so ``l3(n) = h(n) - l2(n)`` pages follow the L2 run from L3;
  - ``score(n) = page_tokens · (l2(n) + l3_weight · l3(n)) - load_weight · queue(n)``,
    ``queue(n)`` the prefill tokens pending there.

  The router sends the request to the node with the highest score (the first in
  :attr:`Router.nodes` of equal ones). With ``load_weight`` 1 that is the node with the
  least ``queue(n) + prefill(n)``, where ``prefill(n)`` is the request's tokens less those
  ``n`` holds, L3's counted at ``1 - l3_weight`` of a recomputed one: the time to first token
  in tokens of prefill, as routers that read vLLM's KV events weigh overlap against load.

The ``kvtier`` policy answers in O(prompt pages) set operations, not O(nodes × pages): an
inverted index per layout maps each page key's tag (its last 64 bits, as
:class:`kvtier.events.KeySet` keeps them) to the nodes whose L2 holds it (a bitset) and the
number of nodes whose L3 view holds it, kept from the views' changes as events are applied
(:class:`kvtier.events.FleetIndex` ``changes``). A decision looks the prompt's tags up in one
vectorized pass, walks the runs of equal entries (a system prompt, a user's continuation)
while the sets of nodes still in the run shrink, noting where each node drops out, then
scores every node in a few numpy operations over the nodes.
"""

from __future__ import annotations

import enum
import hashlib
import random
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.events import EventBatch, EventTier, FleetIndex

__all__ = ["Decision", "Policy", "Router"]


class Policy(enum.Enum):
    """How a :class:`Router` chooses (module docstring)."""

    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    PREFIX_HASH = "prefix_hash"
    KVTIER = "kvtier"

    @classmethod
    def parse(cls, name: str) -> Policy:
        """The policy named ``name``; a ``ValueError`` naming it and the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"routing: policy {name!r} is not one of {choices}") from None


@dataclass(frozen=True)
class Decision:
    """Where a request goes, and why: ``l2_pages``, ``l3_pages`` and ``score`` are the
    ``kvtier`` policy's (module docstring) for the chosen node, 0 under the other policies."""

    node: str
    index: int
    """The node's place in :attr:`Router.nodes` (where its ``queue`` entry is)."""
    l2_pages: int = 0
    l3_pages: int = 0
    score: float = 0.0


_SHIFT = 16
_COUNT = (1 << _SHIFT) - 1
MAX_NODES = _COUNT
"""At most this many nodes: each page's L3 count must fit its field."""
_SPILL = 4096


class _Table:
    """One layout's inverted index: page tag → entry, an open-addressing hash table in two
    numpy arrays (16 bytes a slot, at most half full), so that a prompt's thousands of
    lookups are a few vectorized gathers (:meth:`lookup`), not a chain of dict probes each
    waiting on memory.

    An entry (int64, never 0) is ``holders << 16 | count``: ``count`` the nodes whose L3 view
    holds the page, ``holders`` above 0 the one node whose L2 holds it plus 1, below 0 minus
    one plus the index of a bitset in :attr:`sets` (two or more nodes), 0 none. Linear
    probing from the tag's top bits (tags are SHA-256 output) without wrapping: the arrays
    have :data:`_SPILL` slots past the last home; deletion shifts back, so there are no
    tombstones. Tag 0 marks an empty slot: a key whose tag is 0 is kept as 1."""

    __slots__ = ("keys", "vals", "bits", "size", "sets", "set_ids", "set_refs", "free")

    def __init__(self, bits: int = 10) -> None:
        self.bits = bits
        self.keys = np.zeros((1 << bits) + _SPILL, np.uint64)
        self.vals = np.zeros((1 << bits) + _SPILL, np.int64)
        self.size = 0
        self.sets: list[int] = []  # bitsets of two or more nodes (bit i: node i)
        self.set_ids: dict[int, int] = {}
        self.set_refs: list[int] = []
        self.free: list[int] = []

    def _slot(self, t: int) -> tuple[int, bool]:
        """(where ``t`` is, True) or (the empty slot where it would go, False)."""
        keys = self.keys
        i = t >> (64 - self.bits)
        while True:
            k = keys.item(i)
            if k == t:
                return i, True
            if k == 0:
                return i, False
            i += 1

    def get(self, t: int) -> int:
        i, found = self._slot(t or 1)
        return self.vals.item(i) if found else 0

    def put(self, t: int, v: int) -> None:
        """Sets ``t``'s entry to ``v``; 0 removes it."""
        t = t or 1
        i, found = self._slot(t)
        if v:
            if not found:
                if i >= len(self.keys) - 1 or 2 * (self.size + 1) > (1 << self.bits):
                    self._grow()
                    i, _ = self._slot(t)
                self.keys[i] = t
                self.size += 1
            self.vals[i] = v
        elif found:
            self._delete(i)

    def _delete(self, i: int) -> None:
        keys, vals, shift = self.keys, self.vals, 64 - self.bits
        j = i
        while True:
            j += 1
            k = keys.item(j)
            if k == 0:
                break
            if k >> shift <= i:  # its home is at or before the hole: it moves back into it
                keys[i] = k
                vals[i] = vals.item(j)
                i = j
        keys[i] = 0
        vals[i] = 0
        self.size -= 1

    def _grow(self) -> None:
        live = self.keys != 0
        keys, vals = self.keys[live], self.vals[live]
        bits = self.bits
        while True:
            bits += 1
            home = (keys >> np.uint64(64 - bits)).astype(np.int64)
            order = np.argsort(home, kind="stable")
            home = home[order]
            # Linear probing, placed in order of home: each at its home or just past the one
            # before it.
            r = np.arange(len(home), dtype=np.int64)
            at = np.maximum.accumulate(home - r) + r if len(home) else home
            if not len(at) or at[-1] < (1 << bits) + _SPILL - 1:
                break
        self.bits = bits
        self.keys = np.zeros((1 << bits) + _SPILL, np.uint64)
        self.vals = np.zeros((1 << bits) + _SPILL, np.int64)
        self.keys[at] = keys[order]
        self.vals[at] = vals[order]

    def lookup(self, tags: np.ndarray) -> np.ndarray:
        """Each of ``tags``' entry (0: none), vectorized: each tag's home slot in one gather,
        then the next slot for those neither found nor at an empty slot, and so on."""
        if not tags.all():
            tags = np.where(tags == 0, np.uint64(1), tags)
        at = (tags >> np.uint64(64 - self.bits)).astype(np.int64)
        out = np.zeros(len(tags), np.int64)
        todo = np.arange(len(tags))
        while len(todo):
            k = self.keys[at]
            hit = k == tags
            out[todo[hit]] = self.vals[at[hit]]
            more = ~hit & (k != 0)
            todo, at, tags = todo[more], at[more] + 1, tags[more]
        return out

    def holders(self, v: int) -> int:
        """The L2 holders of entry ``v`` as a bitset (bit i: node i)."""
        h = v >> _SHIFT
        if h > 0:
            return 1 << (h - 1)
        return self.sets[-h - 1] if h < 0 else 0

    def entry(self, nodes: int, count: int, old: int) -> int:
        """The entry for L2 holders ``nodes`` and L3 ``count``, replacing entry ``old`` (whose
        bitset, if any, it releases)."""
        oh = old >> _SHIFT
        if oh < 0:
            s = -oh - 1
            if self.sets[s] == nodes:
                return (oh << _SHIFT) | count
            self.set_refs[s] -= 1
            if not self.set_refs[s]:
                del self.set_ids[self.sets[s]]
                self.sets[s] = 0
                self.free.append(s)
        if not nodes:
            return count
        if not nodes & (nodes - 1):
            return (nodes.bit_length() << _SHIFT) | count
        s = self.set_ids.get(nodes)
        if s is None:
            if self.free:
                s = self.free.pop()
                self.sets[s] = nodes
                self.set_refs[s] = 0
            else:
                s = len(self.sets)
                self.sets.append(nodes)
                self.set_refs.append(0)
            self.set_ids[nodes] = s
        self.set_refs[s] += 1
        return ((-s - 1) << _SHIFT) | count


def _node_ids(nodes: int) -> list[int]:
    """The node ids in a bitset (bit i: node i)."""
    if nodes.bit_count() <= 16:
        ids = []
        while nodes:
            low = nodes & -nodes
            ids.append(low.bit_length() - 1)
            nodes ^= low
        return ids
    raw = np.frombuffer(nodes.to_bytes((nodes.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def _tags(keys: Sequence[bytes]) -> np.ndarray:
    """Each key's tag (its last 8 bytes, little-endian), as :class:`kvtier.events.KeySet`
    keeps them; a ``ValueError`` when a key is not 32 bytes."""
    packed = b"".join(keys)
    if len(packed) != 32 * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != 32)
        raise ValueError(f"routing: keys[{bad}]: a page key is 32 bytes, got {len(keys[bad])}")
    return np.frombuffer(packed, dtype="<u8")[3::4].astype(np.uint64)


class Router:
    """Chooses a node for each request by its :class:`Policy`.

    The nodes are those added (:meth:`add`, :meth:`follow`) or whose events were applied,
    in that order (:attr:`nodes`). For the ``kvtier`` policy the router keeps the nodes'
    views in :attr:`fleet` (a :class:`kvtier.events.FleetIndex`: apply a node's
    :class:`kvtier.events.EventBatch` es with :meth:`apply`, or follow its stream with
    :meth:`follow`) and an inverted index of them. Load comes from the caller, who knows what
    it sent where: ``queue``, the prefill tokens pending per node.

    Parameters (each refused with a ``ValueError`` naming it outside its bounds):

    - ``page_tokens`` (≥ 1, default 16): tokens a page holds, the layout's page size.
    - ``l3_weight`` (0–1, default 0.8): what a page loaded from L3 saves against one in L2.
    - ``load_weight`` (≥ 0, default 1): a queued token's weight against a saved one.
    - ``hash_pages`` (≥ 1, default 4): leading pages ``prefix_hash`` hashes.
    - ``ring_points`` (≥ 1, default 64): points per node on ``prefix_hash``'s ring.
    - ``seed`` (default 0): ``random``'s.

    Thread-safe: events may be applied (by followers' threads) while requests are routed.
    """

    def __init__(
        self,
        policy: Policy | str = Policy.KVTIER,
        nodes: Iterable[str] = (),
        *,
        page_tokens: int = 16,
        l3_weight: float = 0.8,
        load_weight: float = 1.0,
        hash_pages: int = 4,
        ring_points: int = 64,
        seed: int = 0,
    ) -> None:
        self.policy = policy if isinstance(policy, Policy) else Policy.parse(policy)
        for name, value, ok in (
            ("page_tokens", page_tokens, page_tokens >= 1),
            ("l3_weight", l3_weight, 0.0 <= l3_weight <= 1.0),
            ("load_weight", load_weight, load_weight >= 0.0),
            ("hash_pages", hash_pages, hash_pages >= 1),
            ("ring_points", ring_points, ring_points >= 1),
        ):
            if not ok:
                raise ValueError(f"routing: {name}: {value} is out of bounds")
        self.page_tokens, self.l3_weight, self.load_weight = page_tokens, l3_weight, load_weight
        self.hash_pages, self.ring_points = hash_pages, ring_points
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        self._pages: dict[str, _Table] = {}  # by layout
        self._rng = random.Random(seed)
        self._turn = 0
        self._ring: tuple[list[int], list[int]] | None = None
        self.fleet = FleetIndex(changes=self._changed)
        for n in nodes:
            self.add(n)

    @property
    def nodes(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._names)

    def add(self, node: str) -> int:
        """Adds ``node`` (no-op when known); its place in :attr:`nodes`."""
        with self._lock:
            return self._id(node)

    def _id(self, node: str) -> int:
        i = self._ids.get(node)
        if i is None:
            if len(self._names) >= MAX_NODES:
                raise ValueError(f"routing: node {node!r}: at most {MAX_NODES} nodes")
            i = self._ids[node] = len(self._names)
            self._names.append(node)
            self._ring = None
        return i

    def apply(self, node: str, batch: EventBatch) -> None:
        """Applies ``node``'s events (as :meth:`kvtier.events.FleetIndex.apply`)."""
        self.add(node)
        self.fleet.apply(node, batch)

    def follow(self, node: str, address: str, retry_s: float = 0.2) -> None:
        """Follows the kvtierd at ``address`` as ``node`` (:meth:`FleetIndex.follow`)."""
        self.add(node)
        self.fleet.follow(node, address, retry_s)

    def close(self) -> None:
        self.fleet.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _changed(
        self, node: str, tier: EventTier, layout: str, tags: Iterable[int], held: bool
    ) -> None:
        # Called by the fleet index, under its lock, for each page a view gained or lost.
        with self._lock:
            table = self._pages.get(layout)
            if table is None:
                table = self._pages[layout] = _Table()
            i = self._id(node)
            for t in tags:
                old = table.get(t)
                nodes, count = table.holders(old), old & _COUNT
                if tier is not EventTier.L2_HOST:
                    count += 1 if held else -1
                elif held:
                    nodes |= 1 << i
                else:
                    nodes &= ~(1 << i)
                table.put(t, table.entry(nodes, count, old))

    def choose(
        self,
        keys: Sequence[bytes],
        layout: str,
        queue: Sequence[float] | Mapping[str, float] | np.ndarray | None = None,
    ) -> Decision | None:
        """The node for a request whose prompt has page ``keys`` (of ``layout``, the
        fingerprint its events carry); ``queue``: prefill tokens pending per node, in
        :attr:`nodes` order or by name (missing names: 0; ``None``: none anywhere). ``None``
        when the router knows no node."""
        with self._lock:
            n = len(self._names)
            if n == 0:
                return None
            if self.policy is Policy.ROUND_ROBIN:
                i = self._turn % n
                self._turn += 1
            elif self.policy is Policy.RANDOM:
                i = self._rng.randrange(n)
            elif self.policy is Policy.PREFIX_HASH:
                i = self._hash_choice(keys)
            else:
                return self._kvtier_choice(keys, layout, self._queue(queue, n))
            return Decision(self._names[i], i)

    def prefixes(self, keys: Sequence[bytes], layout: str) -> dict[str, tuple[int, int]]:
        """``(l2(n), l3(n))`` (module docstring) for each node with either above 0."""
        with self._lock:
            l2, h, _ = self._walk(_tags(keys), layout)
            return {
                name: (int(a), int(b - a))
                for name, a, b in zip(self._names, l2.tolist(), h.tolist())
                if b > 0
            }

    def _queue(
        self, queue: Sequence[float] | Mapping[str, float] | np.ndarray | None, n: int
    ) -> np.ndarray:
        if queue is None:
            return np.zeros(n)
        if isinstance(queue, Mapping):
            return np.array([float(queue.get(name, 0.0)) for name in self._names])
        q = np.asarray(queue, dtype=np.float64)
        if q.shape != (n,):
            raise ValueError(f"routing: queue: {n} nodes, got {q.shape} entries")
        return q

    def _hash_choice(self, keys: Sequence[bytes]) -> int:
        if self._ring is None:
            ring = sorted(
                (_point(f"{name}#{j}".encode()), i)
                for i, name in enumerate(self._names)
                for j in range(self.ring_points)
            )
            self._ring = ([p for p, _ in ring], [i for _, i in ring])
        points, owners = self._ring
        at = bisect_left(points, _point(b"".join(keys[: self.hash_pages])))
        return owners[at % len(points)]

    def _walk(self, tags: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(``l2(n)`` and ``h(n)`` for every node, the pages looked at)."""
        n = len(self._names)
        l2 = np.zeros(n, dtype=np.int64)
        table = self._pages.get(layout)
        if table is None or not len(tags):
            return l2, np.zeros(n, dtype=np.int64), 0
        vals = table.lookup(tags)
        absent = np.flatnonzero(vals == 0)
        end = int(absent[0]) if len(absent) else len(vals)  # no L2 and no L3 there
        # Runs of pages with the same L2 holders and L3 or not: each run's first page.
        kind = (vals[:end] >> _SHIFT << 1) | ((vals[:end] & _COUNT) > 0)
        starts = [0, *(np.flatnonzero(kind[1:] != kind[:-1]) + 1).tolist()] if end else []
        # Walking the runs: `b`, the nodes whose L2 run is alive; `a`, those tracked whose run
        # in their L2 or L3 is; `base`, every page so far is in L3, so each node not tracked is
        # alive too (a node is tracked from the first page its L2 holds while `base` lasts;
        # one seen later had dropped out already, where `base` ended: g3).
        b = a = 0
        base = True
        g3 = end
        b_drops: list[tuple[int, int]] = []
        a_drops: list[tuple[int, int]] = []
        pos = end
        for pos in starts:
            v = vals.item(pos)
            nodes = table.holders(v)
            if pos == 0:
                b = nodes
            elif b:
                kept = b & nodes
                if kept != b:
                    b_drops.append((pos, b ^ kept))
                    b = kept
            if base:
                a |= nodes
            if not v & _COUNT:
                if base:
                    base, g3 = False, pos
                kept = a & nodes
                if kept != a:
                    a_drops.append((pos, a ^ kept))
                    a = kept
                if not a:
                    break
        else:
            pos = end
        h = np.full(n, g3, dtype=np.int64)
        for at, dropped in [*b_drops, (pos, b)]:
            if dropped:
                l2[_node_ids(dropped)] = at
        for at, dropped in [*a_drops, (pos, a)]:
            if dropped:
                h[_node_ids(dropped)] = at
        return l2, h, pos

    def _kvtier_choice(self, keys: Sequence[bytes], layout: str, queue: np.ndarray) -> Decision:
        l2, h, _ = self._walk(_tags(keys), layout)
        score = self.page_tokens * (l2 + self.l3_weight * (h - l2)) - self.load_weight * queue
        i = int(np.argmax(score))
        return Decision(self._names[i], i, int(l2[i]), int(h[i] - l2[i]), float(score[i]))


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
