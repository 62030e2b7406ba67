"""One router process (``kvtier.routing.Router``, the ``kvtier`` policy) over simulated fleets
of 64, 256 and 1,024 nodes: what its index takes, how fast it decides, how fast it applies
events, and where it stops keeping up with the fleet's event streams (docs/routing.md,
"Routing at fleet scale").

    python benches/router_scale_bench.py [--quick] [--json] [--check] [--sizes 64,256,1024]

The fleet (per size N, seeded): 32 system prompts of 128-1,024 pages (page 16 tokens), chosen
by Zipf popularity; each node serves users whose cached conversation is a system prompt then
a continuation of their own, so a returning user's prompt is 2,048 pages (the system prompt,
the continuation, 64 new pages); a fifth of each node's users are cached on a second node too;
each node writes its system prompts and half its continuations to the shared L3 and holds two
more users' pages in L3 alone (evicted from L2). Pages per node in L2: 16,384 (2,048 with
``--quick``), fed as STORED events in batches of 1,024.

Each size runs in a child process of its own (memory is read from it alone). Rows:

- **router index memory**: the child's RSS after the fleet's events less before (the
  router's views and inverted index, no workload), MiB; beside it the bytes per page held
  (L2 and L3 pages summed over nodes).
- **router decision p99 / p50**: ``Router.choose`` for 2,048-page prompts (4/5 returning
  users, 1/5 new users of a popular system prompt) with a random queue per node, wall clock
  (p99 beside its p50; p50 beside ``FleetIndex.route``, which scans every node, on the same
  prompts). Goal: p99 ≤ 1 ms at 1,024 nodes (``--check`` fails beyond it).
- **router event apply**: events/s applied as a node's stream delivers them in steady state
  (batches of ``rate`` × 2 ms events: kvtierd's linger; pages stored and evicted in L2 and
  L3), beside the build's rate (batches of 1,024).
- **router event lag p99**: one thread both applies the fleet's streams, each node at
  ``--node-rate`` events/s (default 2,000: the sim's full-speed replay moved 1,830 pages/s
  through one kvtierd, BENCHMARKS.md), and routes N/2 requests/s (a node prefilling 2k-page
  prompts at ~16k tokens/s takes ~0.5 a second), in real time for a few seconds: how long
  after a batch is due it is applied; the events left behind at the end beside it.
- **router keeps up with**: at 1,024 nodes, the most events/s (with the same requests/s) for
  which that lag stays bounded (the backlog at the end under 50 ms of events), found by
  running the loop at rising rates; beside it the nodes that is at ``--node-rate``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# This checkout's package, whether or not the venv installed it (kvtier-bench runs this with
# the venv's python and no PYTHONPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kvtier.events import EventBatch, EventKind, EventTier, PageEvent  # noqa: E402
from kvtier.routing import Router  # noqa: E402

LAYOUT = "ab" * 16
PROMPT = 2048
NEW = 64
LINGER = 0.002
GOAL_P99_MS = 1.0
L2, L3 = EventTier.L2_HOST, EventTier.L3_STORAGE
STORED, REMOVED = EventKind.STORED, EventKind.REMOVED


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pages(seed: int, n: int) -> list[bytes]:
    blob = random.Random(seed).randbytes(32 * n)
    return [blob[i : i + 32] for i in range(0, 32 * n, 32)]


class Fleet:
    """The simulated fleet's contents: system prompts, users, who holds what."""

    def __init__(self, nodes: int, per_node: int, seed: int = 7) -> None:
        rng = random.Random(seed * 7919 + nodes)
        self.nodes = nodes
        lengths = [rng.randint(128, 1024) for _ in range(32)]
        self.systems = [pages(seed * 100 + i, n) for i, n in enumerate(lengths)]
        weights = [1 / (i + 1) for i in range(32)]  # Zipf
        # users[u] = (system prompt, continuation pages, seed of its keys)
        self.users: list[tuple[int, int, int]] = []
        self.held: list[list[int]] = [[] for _ in range(nodes)]  # users in L2
        self.l3_only: list[list[int]] = [[] for _ in range(nodes)]
        for n in range(nodes):
            total = 0
            while total < per_node:
                s = rng.choices(range(32), weights)[0]
                u = len(self.users)
                self.users.append((s, PROMPT - NEW - len(self.systems[s]), rng.getrandbits(48)))
                self.held[n].append(u)
                total += self.users[u][1]
            for _ in range(2):
                s = rng.choices(range(32), weights)[0]
                self.users.append((s, PROMPT - NEW - len(self.systems[s]), rng.getrandbits(48)))
                self.l3_only[n].append(len(self.users) - 1)
        for n in range(nodes):  # a fifth of each node's users cached on the next node too
            mine = self.held[n]
            self.held[(n + 1) % nodes] += mine[: len(mine) // 5]

    def continuation(self, u: int) -> list[bytes]:
        _, c, seed = self.users[u]
        return pages(seed, c)

    def prompt(self, u: int, rng: random.Random) -> list[bytes]:
        s = self.users[u][0]
        return self.systems[s] + self.continuation(u) + pages(rng.getrandbits(48), NEW)

    def events(self, n: int):
        """Node ``n``'s events, as its stream's snapshot would list them."""
        systems = sorted({self.users[u][0] for u in self.held[n] + self.l3_only[n]})
        for s in systems:
            for k in self.systems[s]:
                yield PageEvent(0, 0, STORED, k, None, LAYOUT, L2)
                yield PageEvent(0, 0, STORED, k, None, LAYOUT, L3)
        for i, u in enumerate(self.held[n]):
            for k in self.continuation(u):
                yield PageEvent(0, 0, STORED, k, None, LAYOUT, L2)
                if i % 2 == 0:
                    yield PageEvent(0, 0, STORED, k, None, LAYOUT, L3)
        for u in self.l3_only[n]:
            for k in self.continuation(u):
                yield PageEvent(0, 0, STORED, k, None, LAYOUT, L3)


def build(fleet: Fleet, router: Router) -> tuple[int, float]:
    """Applies every node's events in batches of 1,024: (events, seconds applying)."""
    count, spent = 0, 0.0
    for n in range(fleet.nodes):
        name = f"node-{n}"
        router.add(name)
        events = list(fleet.events(n))
        for i in range(0, len(events), 1024):
            b = EventBatch(1, name, tuple(events[i : i + 1024]))
            t = time.perf_counter()
            router.apply(name, b)
            spent += time.perf_counter() - t
        count += len(events)
    return count, spent


class Churn:
    """Each node's steady stream, cyclic: a turn of 32 new pages stored in L2 and L3, the
    L2 copy of the turn two before evicted and the L3 copy of the one three before; per node
    a ring of 4 turns of its own keys. ``next_batch`` is node after node (as their batches
    arrive when every node lingers the same), ``per_batch`` events each."""

    TURNS, TURN = 4, 32

    def __init__(self, nodes: int, per_batch: int, seed: int = 11) -> None:
        self.per_batch = per_batch
        self.flat: list[list[PageEvent]] = []
        for n in range(nodes):
            turns = [pages(seed * 1_000_000 + n * 10 + t, self.TURN) for t in range(self.TURNS)]
            seq: list[PageEvent] = []
            for t in range(self.TURNS):
                seq += [PageEvent(0, 0, STORED, k, None, LAYOUT, L2) for k in turns[t]]
                seq += [PageEvent(0, 0, STORED, k, None, LAYOUT, L3) for k in turns[t]]
                seq += [PageEvent(0, 0, REMOVED, k, None, LAYOUT, L2) for k in turns[t - 2]]
                seq += [PageEvent(0, 0, REMOVED, k, None, LAYOUT, L3) for k in turns[t - 3]]
            self.flat.append(seq)
        self.names = [f"node-{n}" for n in range(nodes)]
        self.cursor = [0] * nodes
        self.turn = 0

    def next_batch(self) -> tuple[str, EventBatch]:
        n = self.turn
        self.turn = (n + 1) % len(self.flat)
        seq, at = self.flat[n], self.cursor[n]
        events = seq[at : at + self.per_batch]
        if len(events) < self.per_batch:
            events += seq[: self.per_batch - len(events)]
        self.cursor[n] = (at + self.per_batch) % len(seq)
        return self.names[n], EventBatch(1, self.names[n], tuple(events))


def decisions(fleet: Fleet, router: Router, count: int, rng: random.Random):
    """Wall and CPU seconds of each ``choose``, and a sample of prompts for the baseline."""
    n = fleet.nodes
    queues = [np.array([rng.randrange(0, 20_000) for _ in range(n)], float) for _ in range(16)]
    popular = [u for u in range(len(fleet.users)) if fleet.users[u][0] < 4]
    wall, cpu, sample = [], [], []
    for i in range(count):
        if rng.random() < 0.8:
            node = rng.randrange(n)
            ks = fleet.prompt(rng.choice(fleet.held[node]), rng)
        else:
            s = fleet.users[rng.choice(popular)][0]
            ks = fleet.systems[s] + pages(rng.getrandbits(48), PROMPT - len(fleet.systems[s]))
        if i < 30:
            sample.append(ks)
        t, c = time.perf_counter(), time.thread_time()
        d = router.choose(ks, LAYOUT, queues[i % 16])
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
        assert d is not None
    return wall, cpu, sample


def simulate(
    router: Router, churn: Churn, fleet: Fleet, events_s: float, requests_s: float, secs: float
) -> dict[str, float]:
    """One thread applies the fleet's batches as they fall due and routes requests as they
    fall due, in real time for ``secs``: the lag of each batch (applied − due) and the events
    due but not applied at the end."""
    rng = random.Random(5)
    batch_every = churn.per_batch / events_s
    request_every = 1.0 / requests_s if requests_s else float("inf")
    prompts = [fleet.prompt(rng.choice(fleet.held[rng.randrange(fleet.nodes)]), rng)]
    prompts += [fleet.prompt(rng.choice(fleet.held[rng.randrange(fleet.nodes)]), rng)]
    queue = np.zeros(fleet.nodes)
    lags: list[float] = []
    applied = routed = 0
    next_batch, next_request = 0.0, 0.0
    gc.collect()
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        if now >= secs:
            break
        due = min(next_batch, next_request)
        if due > now:
            if due - now > 0.0005:
                time.sleep(due - now - 0.0003)
            continue
        if next_batch <= next_request:
            name, b = churn.next_batch()
            router.apply(name, b)
            applied += 1
            lags.append(time.perf_counter() - t0 - next_batch)
            next_batch += batch_every
        else:
            router.choose(prompts[routed % 2], LAYOUT, queue)
            routed += 1
            next_request += request_every
    end = time.perf_counter() - t0
    behind = max(0.0, (end / batch_every - applied) * churn.per_batch)
    lags.sort()
    return {
        "events_s": events_s,
        "requests_s": requests_s,
        "lag_p50_ms": lags[len(lags) // 2] * 1e3 if lags else 0.0,
        "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1e3 if lags else 0.0,
        "behind": behind,
        "kept_up": float(behind < 0.05 * events_s),
        "applied_events": applied * churn.per_batch,
        "routed": routed,
    }


def one(nodes: int, quick: bool, node_rate: float, limit: bool) -> dict[str, object]:
    per_node = 2048 if quick else 16384
    fleet = Fleet(nodes, per_node)
    gc.collect()
    before = rss()
    router = Router("kvtier")
    count, spent = build(fleet, router)
    gc.collect()
    memory = rss() - before
    held_total = 0
    for n in range(nodes):
        v = router.fleet.view(f"node-{n}")
        held_total += v.held(L2) + v.held(L3)
    rng = random.Random(3)
    wall, cpu, sample = decisions(fleet, router, 300 if quick else 2000, rng)
    wall.sort()
    cpu.sort()
    # The scan the router replaces, on a few of the same prompts.
    scans = []
    for ks in sample[:10]:
        t = time.perf_counter()
        router.fleet.route(ks, LAYOUT)
        scans.append(time.perf_counter() - t)
    scans.sort()
    per_batch = max(1, round(node_rate * LINGER))
    churn = Churn(nodes, per_batch)
    n_batches = 20_000 if quick else 100_000
    t = time.perf_counter()
    for _ in range(n_batches):
        name, b = churn.next_batch()
        router.apply(name, b)
    churn_rate = n_batches * per_batch / (time.perf_counter() - t)
    secs = 1.5 if quick else 4.0
    nominal = simulate(router, churn, fleet, nodes * node_rate, nodes / 2, secs)
    out: dict[str, object] = {
        "nodes": nodes,
        "per_node": per_node,
        "memory": memory,
        "held": held_total,
        "build_events": count,
        "build_rate": count / spent,
        "p50": wall[len(wall) // 2],
        "p99": wall[int(len(wall) * 0.99)],
        "cpu_p99": cpu[int(len(cpu) * 0.99)],
        "scan_p50": scans[len(scans) // 2],
        "churn_rate": churn_rate,
        "per_batch": per_batch,
        "nominal": nominal,
    }
    if limit:
        # Rising rates from well under what churn_rate says one thread applies.
        points = []
        for f in (0.3, 0.5, 0.7, 0.85, 1.0, 1.2):
            points.append(simulate(router, churn, fleet, f * churn_rate, nodes / 2, secs / 2))
        out["sweep"] = points
    router.close()
    return out


ROWS: list[dict[str, object]] = []


def row(figure: str, value: float, unit: str, baseline: str, base: float, ratio) -> None:
    ROWS.append(
        {
            "figure": figure,
            "value": value,
            "unit": unit,
            "baseline": baseline,
            "baseline_value": base,
            "ratio": ratio,
        }
    )
    print(f"{figure:<58} {value:11.3f} {unit:<9} {baseline} {base:11.3f}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--node-rate", type=float, default=2000.0, help="events/s per node")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--limit", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.quick, a.node_rate, a.limit)))
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    missed = []
    for n in sizes:
        cmd = [sys.executable, __file__, "--one", str(n), "--node-rate", str(a.node_rate)]
        cmd += ["--quick"] if a.quick else []
        cmd += ["--limit"] if n == max(sizes) else []
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        held = r["held"]
        row(
            f"router index memory, {n} nodes, {r['per_node'] // 1024}k pages each",
            r["memory"] / 2**20,
            "MiB",
            "B per page held",
            r["memory"] / held,
            None,
        )
        row(
            f"router decision p99, {n} nodes, 2k-page prompt",
            r["p99"] * 1e3,
            "ms",
            "p50",
            r["p50"] * 1e3,
            None,
        )
        row(
            f"router decision p50, {n} nodes, 2k-page prompt",
            r["p50"] * 1e3,
            "ms",
            "FleetIndex.route p50 (scan)",
            r["scan_p50"] * 1e3,
            r["scan_p50"] / r["p50"],
        )
        print(f"  (decision CPU time p99 {r['cpu_p99'] * 1e3:.3f} ms)", file=sys.stderr)
        row(
            f"router event apply, {n} nodes, batches of {r['per_batch']}",
            r["churn_rate"],
            "events/s",
            "build, batches of 1,024",
            r["build_rate"],
            None,
        )
        nom = r["nominal"]
        row(
            f"router event lag p99, {n} nodes at {nom['events_s'] / 1e3:.0f}k events/s "
            f"+ {nom['requests_s']:.0f} req/s",
            nom["lag_p99_ms"],
            "ms",
            "events behind at the end",
            nom["behind"],
            None,
        )
        if n == 1024 and r["p99"] * 1e3 > GOAL_P99_MS:
            missed.append(f"decision p99 at 1,024 nodes {r['p99'] * 1e3:.3f} ms > 1 ms")
        for p in r.get("sweep", []):
            print(
                f"  {n} nodes: {p['events_s'] / 1e3:7.0f}k events/s + {p['requests_s']:.0f} "
                f"req/s: lag p50 {p['lag_p50_ms']:9.1f} ms p99 {p['lag_p99_ms']:9.1f} ms, "
                f"{p['behind']:9.0f} behind at the end, kept up: {bool(p['kept_up'])}",
                file=sys.stderr,
            )
        kept = [p["events_s"] for p in r.get("sweep", []) if p["kept_up"]]
        if "sweep" in r:
            best = max(kept, default=0.0)
            row(
                f"router keeps up with, {n} nodes' index + {n // 2} req/s",
                best,
                "events/s",
                f"nodes at {a.node_rate:.0f} events/s",
                best / a.node_rate,
                None,
            )
    if a.json:
        print(json.dumps(ROWS))
    if a.check and missed:
        print("goal missed: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
