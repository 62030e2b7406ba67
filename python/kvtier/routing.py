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
import heapq
import math
import random
import secrets
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
_SPILL = 64
_MIN_BITS = 4
_M64 = (1 << 64) - 1
_C2 = 0x94D049BB133111EB  # splitmix64's second multiplier


class _Table:
    """One layout's inverted index: page tag → entry, an open-addressing hash table in two
    numpy arrays (16 bytes a slot, at most half full), so that a prompt's thousands of
    lookups are a few vectorized gathers (:meth:`lookup`), not a chain of dict probes each
    waiting on memory.

    An entry (int64, never 0) is ``holders << 16 | count``: ``count`` the nodes whose L3 view
    holds the page, ``holders`` above 0 the one node whose L2 holds it plus 1, below 0 minus
    one plus the index of a bitset in :attr:`sets` (two or more nodes), 0 none.

    A slot holds the tag's *mix* (:meth:`mix`): a bijection of the 64 bits keyed by two
    secret random values drawn per table (``secrets``), so that tags chosen to share their
    bits (a peer's events are input) still scatter over the table; without the key, 4,200
    tags near 2⁶⁴ or 20,000 sharing their top 44 bits piled into one run. Linear probing
    from the mix's top bits without wrapping: the arrays have :data:`_SPILL` slots past the
    last home, and the last slot is always empty (a put that would fill it grows the table
    first), so every probe ends inside the arrays. Deletion shifts back, so there are no
    tombstones. Mix 0 marks an empty slot: the one tag that mixes to 0 is kept as mix 1 (a
    secret pair of tags shares an entry, as two keys sharing a tag do). The table shrinks
    when a removal leaves it under 1/8 full."""

    __slots__ = (
        "keys",
        "vals",
        "bits",
        "size",
        "sets",
        "set_ids",
        "set_refs",
        "free",
        "_k0",
        "_k1",
    )

    def __init__(self, bits: int = _MIN_BITS, key: tuple[int, int] | None = None) -> None:
        self._k0, self._k1 = key or (secrets.randbits(64), secrets.randbits(64) | 1)
        self._k1 |= 1  # odd: multiplying by it is a bijection
        self.bits = bits
        self.keys = np.zeros((1 << bits) + _SPILL, np.uint64)
        self.vals = np.zeros((1 << bits) + _SPILL, np.int64)
        self.size = 0
        self.sets: list[int] = []  # bitsets of two or more nodes (bit i: node i)
        self.set_ids: dict[int, int] = {}
        self.set_refs: list[int] = []
        self.free: list[int] = []

    def mix(self, t: int) -> int:
        """``t``'s slot value: xor a secret, multiply by a secret odd number, then
        splitmix64's finish (each step a bijection of 64 bits); never 0."""
        x = ((t ^ self._k0) * self._k1) & _M64
        x ^= x >> 32
        x = (x * _C2) & _M64
        x ^= x >> 29
        return x or 1

    def mix_many(self, tags: np.ndarray) -> np.ndarray:
        """:meth:`mix` of each of ``tags`` (uint64), vectorized."""
        x = (tags ^ np.uint64(self._k0)) * np.uint64(self._k1)
        x ^= x >> np.uint64(32)
        x *= np.uint64(_C2)
        x ^= x >> np.uint64(29)
        if not x.all():
            x[x == 0] = 1
        return x

    def _slot(self, m: int) -> tuple[int, bool]:
        """(where mix ``m`` is, True) or (the empty slot where it would go, False)."""
        keys = self.keys
        i = m >> (64 - self.bits)
        while True:
            k = keys.item(i)
            if k == m:
                return i, True
            if k == 0:
                return i, False
            i += 1

    def find(self, t: int) -> tuple[int, int, int]:
        """(``t``'s mix, the slot where it is or the empty one where it would go, its entry:
        0 none), for :meth:`set`."""
        m = self.mix(t)
        i, found = self._slot(m)
        return m, i, self.vals.item(i) if found else 0

    def get(self, t: int) -> int:
        return self.find(t)[2]

    def put(self, t: int, v: int) -> None:
        """Sets ``t``'s entry to ``v``; 0 removes it (without shrinking: :meth:`trim`)."""
        self.set(*self.find(t), v)

    def set(self, m: int, i: int, old: int, v: int) -> None:
        """Sets the entry of mix ``m`` that :meth:`find` found at ``i`` as ``old`` to ``v``
        (0: removes it). Raises, changing nothing, when the table cannot grow."""
        if v:
            if not old:
                # Grow first when the table would pass half full, or the slot is the last
                # one (which stays empty, so probes end inside the arrays).
                while i >= len(self.keys) - 1 or 2 * (self.size + 1) > (1 << self.bits):
                    self._resize(self.bits + 1)
                    i, _ = self._slot(m)
                self.keys[i] = m
                self.size += 1
            self.vals[i] = v
        elif old:
            self._delete(i)

    def reserve(self, more: int) -> None:
        """Grows now (once) so that ``more`` new entries keep it at most half full."""
        need = self.bits
        while 2 * (self.size + more) > (1 << need):
            need += 1
        if need > self.bits:
            self._resize(need)

    def trim(self) -> None:
        """Shrinks the table when it is under 1/8 full, to about 1/4 full."""
        if self.bits > _MIN_BITS and 8 * self.size < (1 << self.bits):
            self._resize(max(_MIN_BITS, (4 * self.size).bit_length()), smaller=True)

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

    def _resize(self, bits: int, smaller: bool = False) -> None:
        """Rebuilds at ``bits`` (or the fewest above it whose placement leaves the last slot
        empty); the arrays are replaced only once the new ones are whole."""
        live = self.keys != 0
        keys, vals = self.keys[live], self.vals[live]
        while True:
            home = (keys >> np.uint64(64 - bits)).astype(np.int64)
            order = np.argsort(home, kind="stable")
            home = home[order]
            # Linear probing, placed in order of home: each at its home or just past the one
            # before it.
            r = np.arange(len(home), dtype=np.int64)
            at = np.maximum.accumulate(home - r) + r if len(home) else home
            if not len(at) or at[-1] < (1 << bits) + _SPILL - 1:
                break
            if smaller and bits + 1 >= self.bits:
                return  # no smaller table fits: keep this one
            bits += 1
        new_keys = np.zeros((1 << bits) + _SPILL, np.uint64)
        new_vals = np.zeros((1 << bits) + _SPILL, np.int64)
        new_keys[at] = keys[order]
        new_vals[at] = vals[order]
        self.bits, self.keys, self.vals = bits, new_keys, new_vals

    def lookup(self, tags: np.ndarray) -> np.ndarray:
        """Each of ``tags``' entry (0: none), vectorized: each tag's home slot in one gather,
        then the next slot for those neither found nor at an empty slot, and so on."""
        mixed = self.mix_many(tags)
        at = (mixed >> np.uint64(64 - self.bits)).astype(np.int64)
        out = np.zeros(len(tags), np.int64)
        todo = np.arange(len(tags))
        while len(todo):
            k = self.keys[at]
            hit = k == mixed
            out[todo[hit]] = self.vals[at[hit]]
            more = ~hit & (k != 0)
            todo, at, mixed = todo[more], at[more] + 1, mixed[more]
        return out

    def holders(self, v: int) -> int:
        """The L2 holders of entry ``v`` as a bitset (bit i: node i)."""
        h = v >> _SHIFT
        if h > 0:
            return 1 << (h - 1)
        return self.sets[-h - 1] if h < 0 else 0

    def entry(self, nodes: int, count: int) -> int:
        """The entry for L2 holders ``nodes`` and L3 ``count``, holding a reference on its
        bitset (if any) until :meth:`release` d."""
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

    def release(self, v: int) -> None:
        """Drops entry ``v``'s reference on its bitset, if it has one."""
        h = v >> _SHIFT
        if h < 0:
            s = -h - 1
            self.set_refs[s] -= 1
            if not self.set_refs[s]:
                del self.set_ids[self.sets[s]]
                self.sets[s] = 0
                self.free.append(s)


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
    try:
        packed = b"".join(keys)
    except TypeError:
        bad = next(i for i, k in enumerate(keys) if not isinstance(k, (bytes, bytearray)))
        raise ValueError(f"routing: keys[{bad}]: a page key is bytes, got {keys[bad]!r}") from None
    if len(packed) != 32 * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != 32)
        raise ValueError(f"routing: keys[{bad}]: a page key is 32 bytes, got {len(keys[bad])}")
    return np.frombuffer(packed, dtype="<u8")[3::4].astype(np.uint64)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` when it is an int (not a bool) in ``lo``–``hi``; a ``ValueError`` naming
    ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"routing: {name}: {value!r} is not an integer")
    if value < lo or (hi is not None and value > hi):
        bounds = f"{lo}–{hi}" if hi is not None else f"≥ {lo}"
        raise ValueError(f"routing: {name}: {value} is out of bounds ({bounds})")
    return int(value)


def _real(name: str, value: object, lo: float, hi: float | None = None) -> float:
    """``value`` as a float when it is a finite number (not a bool) in ``lo``–``hi``; a
    ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"routing: {name}: {value!r} is not a number")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
        bounds = f"{lo:g}–{hi:g}" if hi is not None else f"≥ {lo:g}"
        raise ValueError(f"routing: {name}: {value!r} is out of bounds (finite, {bounds})")
    return v


MAX_PAGE_TOKENS = 1 << 20
MAX_RING_POINTS = 4096


class Router:
    """Chooses a node for each request by its :class:`Policy`.

    The nodes are those added (:meth:`add`, :meth:`follow`) or whose events were applied,
    less those removed (:meth:`remove`): :attr:`nodes`, in order of place. A node added takes
    the first place a removed one left, else the next at the end; so a removal shifts the
    nodes after it down by one, and an addition may land in the middle. Queues given as
    sequences, and :attr:`Decision.index`, follow :attr:`nodes` as it is at the call.

    For the ``kvtier`` policy the router keeps the nodes' views in :attr:`fleet` (a
    :class:`kvtier.events.FleetIndex`: apply a node's :class:`kvtier.events.EventBatch` es
    with :meth:`apply`, or follow its stream with :meth:`follow`) and an inverted index of
    them. Load comes from the caller, who knows what it sent where: ``queue``, the prefill
    tokens pending per node.

    Parameters (each refused with a ``ValueError`` naming it when of the wrong type, not
    finite, or outside its bounds; a bool is not a number here):

    - ``page_tokens`` (an int, 1 – 2²⁰, default 16): tokens a page holds, the layout's page
      size.
    - ``l3_weight`` (0–1, default 0.8): what a page loaded from L3 saves against one in L2.
    - ``load_weight`` (≥ 0, finite, default 1): a queued token's weight against a saved one.
    - ``hash_pages`` (an int ≥ 1, default 4): leading pages ``prefix_hash`` hashes.
    - ``ring_points`` (an int, 1–4,096, default 64): points per node on ``prefix_hash``'s
      ring.
    - ``seed`` (an int, default 0): ``random``'s.

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
        self.page_tokens = _int("page_tokens", page_tokens, 1, MAX_PAGE_TOKENS)
        self.l3_weight = _real("l3_weight", l3_weight, 0.0, 1.0)
        self.load_weight = _real("load_weight", load_weight, 0.0)
        self.hash_pages = _int("hash_pages", hash_pages, 1)
        self.ring_points = _int("ring_points", ring_points, 1, MAX_RING_POINTS)
        seed = _int("seed", seed, -(1 << 63))
        self._lock = threading.Lock()
        # Applying, following and removing one at a time, so that a node removed is not
        # added back halfway by a concurrent apply of its events.
        self._members = threading.RLock()
        self._names: list[str | None] = []  # by place; None: a place a removed node left
        self._ids: dict[str, int] = {}
        self._free: list[int] = []  # places left free, a heap
        self._live: tuple[np.ndarray, tuple[str, ...]] | None = None
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
            return self._places()[1]

    def _places(self) -> tuple[np.ndarray, tuple[str, ...]]:
        """(the places in use, their names), in order."""
        if self._live is None:
            live = [i for i, n in enumerate(self._names) if n is not None]
            self._live = (
                np.array(live, dtype=np.int64),
                tuple(n for n in self._names if n is not None),
            )
        return self._live

    def add(self, node: str) -> int:
        """Adds ``node`` (no-op when known); its place in :attr:`nodes`."""
        i = self._known(node)
        with self._lock:
            return int(np.searchsorted(self._places()[0], i))

    def _known(self, node: str) -> int:
        """``node``'s id, added when new."""
        if not isinstance(node, str) or not node:
            raise ValueError(f"routing: node {node!r}: a node is a non-empty string")
        with self._lock:
            return self._id(node)

    def _id(self, node: str) -> int:
        i = self._ids.get(node)
        if i is None:
            if self._free:
                i = heapq.heappop(self._free)
                self._names[i] = node
            else:
                if len(self._names) >= MAX_NODES:
                    raise ValueError(f"routing: node {node!r}: at most {MAX_NODES} nodes")
                i = len(self._names)
                self._names.append(node)
            self._ids[node] = i
            self._ring = None
            self._live = None
        return i

    def remove(self, node: str) -> bool:
        """Removes ``node``: stops following it, forgets its pages from the index (its L3
        pages no longer count for the others) and drops it from :attr:`nodes`; the nodes
        after it move down a place. Added again later, it starts from an empty view. Whether
        it was known."""
        with self._members:
            known = self.fleet.remove(node)
            with self._lock:
                i = self._ids.pop(node, None)
                if i is None:
                    return known
                self._names[i] = None
                while self._names and self._names[-1] is None:
                    self._names.pop()
                self._free = [j for j in (*self._free, i) if j < len(self._names)]
                heapq.heapify(self._free)
                self._ring = None
                self._live = None
            return True

    def apply(self, node: str, batch: EventBatch) -> None:
        """Applies ``node``'s events (as :meth:`kvtier.events.FleetIndex.apply`)."""
        with self._members:
            self._known(node)
            self.fleet.apply(node, batch)

    def follow(self, node: str, address: str, retry_s: float = 0.2) -> None:
        """Follows the kvtierd at ``address`` as ``node`` (:meth:`FleetIndex.follow`)."""
        with self._members:
            self._known(node)
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
        # Called by the fleet index, under its lock, for pages a view gained or lost. All or
        # nothing: a failure undoes the tags already changed, so the view (which keeps its
        # side as it was when this raises) and the index agree.
        with self._lock:
            table = self._pages.get(layout)
            if table is None:
                if not held:
                    return
                table = self._pages[layout] = _Table()
            i = self._id(node)
            tags = tags if isinstance(tags, (list, tuple)) else list(tags)
            done = 0
            try:
                if held and len(tags) > 1:
                    table.reserve(len(tags))
                for t in tags:
                    self._change(table, i, tier, t, held)
                    done += 1
            except BaseException:
                for t in reversed(tags[:done]):
                    self._change(table, i, tier, t, not held)
                raise
            finally:
                if not table.size:
                    del self._pages[layout]  # no node holds a page of it
                elif not held:
                    try:
                        table.trim()
                    except MemoryError:
                        pass  # the table stays as large as it was

    @staticmethod
    def _change(table: _Table, i: int, tier: EventTier, t: int, held: bool) -> None:
        m, at, old = table.find(t)
        nodes, count = table.holders(old), old & _COUNT
        if tier is not EventTier.L2_HOST:
            count += 1 if held else -1
        elif held:
            nodes |= 1 << i
        else:
            nodes &= ~(1 << i)
        new = table.entry(nodes, count)
        try:
            table.set(m, at, old, new)
        except BaseException:
            table.release(new)
            raise
        table.release(old)

    def choose(
        self,
        keys: Sequence[bytes],
        layout: str,
        queue: Sequence[float] | Mapping[str, float] | np.ndarray | None = None,
    ) -> Decision | None:
        """The node for a request whose prompt has page ``keys`` (of ``layout``, the
        fingerprint its events carry); ``queue``: prefill tokens pending per node, in
        :attr:`nodes` order or by name (missing names: 0; ``None``: none anywhere), each
        finite and ≥ 0 (a ``ValueError`` naming what is wrong otherwise, under every policy:
        a wrong length, an unknown name, NaN, a negative). ``None`` when the router knows no
        node."""
        with self._lock:
            places, names = self._places()
            n = len(names)
            q = self._queue(queue, names)
            if n == 0:
                return None
            if self.policy is Policy.ROUND_ROBIN:
                i = self._turn % n
                self._turn += 1
            elif self.policy is Policy.RANDOM:
                i = self._rng.randrange(n)
            elif self.policy is Policy.PREFIX_HASH:
                i = self._hash_choice(keys, names)
            else:
                return self._kvtier_choice(keys, layout, q, places, names)
            return Decision(names[i], i)

    def prefixes(self, keys: Sequence[bytes], layout: str) -> dict[str, tuple[int, int]]:
        """``(l2(n), l3(n))`` (module docstring) for each node with either above 0."""
        with self._lock:
            places, names = self._places()
            l2, h, _ = self._walk(_tags(keys), layout)
            return {
                name: (int(a), int(b - a))
                for name, a, b in zip(names, l2[places].tolist(), h[places].tolist())
                if b > 0
            }

    def _queue(
        self,
        queue: Sequence[float] | Mapping[str, float] | np.ndarray | None,
        names: Sequence[str],
    ) -> np.ndarray:
        n = len(names)
        if queue is None:
            return np.zeros(n)
        if isinstance(queue, Mapping):
            unknown = [k for k in queue if k not in self._ids]
            if unknown:
                raise ValueError(f"routing: queue: {unknown[0]!r} is not a node")
            vals = [queue.get(name, 0.0) for name in names]
            bad = next((i for i, v in enumerate(vals) if not _is_number(v)), None)
            if bad is not None:
                raise ValueError(f"routing: queue[{names[bad]!r}]: {vals[bad]!r} is not a number")
            q = np.array(vals, dtype=np.float64)
            where = [repr(name) for name in names]
        else:
            if isinstance(queue, (str, bytes)):
                raise ValueError(f"routing: queue: {queue!r} is not a sequence of numbers")
            try:
                raw = np.asarray(queue)
            except (TypeError, ValueError) as e:
                raise ValueError(f"routing: queue: {e}") from None
            if raw.dtype.kind not in "iuf":
                raise ValueError(f"routing: queue: numbers are wanted, got {raw.dtype} entries")
            if raw.shape != (n,):
                raise ValueError(f"routing: queue: {n} nodes, got {raw.shape} entries")
            q = raw.astype(np.float64)
            where = [str(i) for i in range(n)]
        ok = np.isfinite(q) & (q >= 0)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"routing: queue[{where[i]}]: {q[i]} is not finite and ≥ 0")
        return q

    def _hash_choice(self, keys: Sequence[bytes], names: Sequence[str]) -> int:
        if self._ring is None:
            ring = sorted(
                (_point(f"{name}#{j}".encode()), i)
                for i, name in enumerate(names)
                for j in range(self.ring_points)
            )
            self._ring = ([p for p, _ in ring], [i for _, i in ring])
        points, owners = self._ring
        at = bisect_left(points, _point(b"".join(keys[: self.hash_pages])))
        return owners[at % len(points)]

    def _walk(self, tags: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(``l2(n)`` and ``h(n)`` for every place, free ones' 0, the pages looked at)."""
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

    def _kvtier_choice(
        self,
        keys: Sequence[bytes],
        layout: str,
        queue: np.ndarray,
        places: np.ndarray,
        names: tuple[str, ...],
    ) -> Decision:
        l2, h, _ = self._walk(_tags(keys), layout)
        if len(places) != len(l2):  # places a removed node left: not scored
            l2, h = l2[places], h[places]
        score = self.page_tokens * (l2 + self.l3_weight * (h - l2)) - self.load_weight * queue
        i = int(np.argmax(score))
        return Decision(names[i], i, int(l2[i]), int(h[i] - l2[i]), float(score[i]))


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
