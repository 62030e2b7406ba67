"""The router's fleet index (``kvtier.events``) at scale: bytes per page it keeps for one
node, and the time to find a prompt's prefix in it, each beside what a plain Python set of
the keys costs in the same run (what the index kept before ``KeySet``).

    python benches/fleet_index_bench.py [--quick] [--json]

Rows (``kvtier-bench --only events`` runs this and holds the first to issue 43's goal of
64 B a page):

- **fleet index bytes per page**: ``tracemalloc``'s count of what a ``NodeView`` holds after
  applying STORED events for N pages of one node (N = 1M, 200k with ``--quick``), divided by
  N; baseline: a ``set`` of the same 32-byte keys.
- **fleet index prefix lookup, 2k-page prompt**: ``NodeView.prefix`` over a prompt of 2,048
  held pages; baseline: the same walk over the set.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
import tracemalloc

from kvtier.events import EventBatch, EventKind, EventTier, NodeView, PageEvent

ROWS: list[dict[str, object]] = []
LAYOUT = "ab" * 16


def row(figure: str, value: float, unit: str, baseline: str, base: float, ratio: float) -> None:
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
    print(f"{figure:<50} {value:9.3f} {unit:<6} {baseline} {base:9.3f}  ratio {ratio:.3f}")


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(n)]


def batches(ks: list[bytes], size: int = 1024):
    for i in range(0, len(ks), size):
        yield EventBatch(
            1,
            "node",
            tuple(
                PageEvent(i + j + 1, 0, EventKind.STORED, k, None, LAYOUT, EventTier.L2_HOST)
                for j, k in enumerate(ks[i : i + size])
            ),
        )


def measure(build) -> tuple[object, float]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return held, after - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    a = ap.parse_args()
    n = 200_000 if a.quick else 1_000_000
    ks = keys(n)

    def build_view() -> NodeView:
        v = NodeView()
        for b in batches(ks):
            v.apply(b)
        return v

    view, view_bytes = measure(build_view)
    # Each key its own object, as each event's key is (what a set of keys holds).
    plain, set_bytes = measure(lambda: {bytes(bytearray(k)) for k in ks})
    assert isinstance(view, NodeView) and isinstance(plain, set)
    assert view.held() == n == len(plain)
    row(
        f"fleet index bytes per page, {n // 1000}k pages",
        view_bytes / n,
        "B",
        "set of keys",
        set_bytes / n,
        set_bytes / view_bytes,
    )
    prompt = ks[:2048]
    t_view, t_set = [], []
    for _ in range(7 if a.quick else 21):
        t = time.perf_counter()
        assert view.prefix(prompt) == len(prompt)
        t_view.append(time.perf_counter() - t)
        t = time.perf_counter()
        m = 0
        for k in prompt:
            if k not in plain:
                break
            m += 1
        assert m == len(prompt)
        t_set.append(time.perf_counter() - t)
    v, s = statistics.median(t_view) * 1e3, statistics.median(t_set) * 1e3
    row("fleet index prefix lookup, 2k-page prompt", v, "ms", "set of keys", s, s / v)
    if a.json:
        print(json.dumps(ROWS))


if __name__ == "__main__":
    main()
