"""Host memory per SGLang worker with ``--hicache-host-memory-mode cache`` against
``buffer_only``, at the same hit rate, with kvtierd as the node's shared store.

    KVTIERD_BIN=target/release/kvtierd python benches/sglang_buffer_only.py [--check]

Each worker is SGLang's own device pool, host pool (sized by ``--hicache-ratio`` as SGLang
sizes it: 2.0, its cache-mode default, against ``--buffer-ratio`` for buffer_only) and
HiCacheController with kvtier as its ``dynamic`` backend (kvtier/testing/sglang_controller.py
says what runs in SGLang's place on a CPU). The same seeded trace of requests (prompts of
shared page chains, spread over the workers) runs in each mode against its own kvtierd:

- cache: a request's leading pages still in the worker's host pool are hits there; the next
  ones come from kvtierd into the host pool and stay; the rest are computed and written
  through, and stay (the host pool is a cache; its oldest pages go when it is full).
- buffer_only: the hit comes from kvtierd into a bounce freed once read; computed pages are
  staged, written, and freed at the storage ack (the host pool is a staging buffer).

Every hit page is compared with the bytes its key was written with. Prints one row per mode
(host bytes per worker, peak host pages in use, hit rate, wrong pages) and the ratio.
``--check`` fails when the ratio is above 0.25, the hit rates differ, a page was wrong, or a
written page was given up.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path


def run_mode(socket: str, mode: str, a, ratio: float) -> dict:
    import torch

    from kvtier.testing.sglang import keys
    from kvtier.testing.sglang_controller import PAGE, Node, page_bytes

    nodes = [
        Node(socket, mode, a.layout, device_pages=a.device_pages, ratio=ratio)
        for _ in range(a.workers)
    ]
    prompts = [keys(a.pages, salt=f"prompt-{p}") for p in range(a.prompts)]
    rng = random.Random(a.seed)
    requested = hits = wrong = 0
    lru: list[OrderedDict[str, None]] = [OrderedDict() for _ in nodes]
    try:
        for r in range(a.requests):
            node, seen = nodes[r % len(nodes)], lru[r % len(nodes)]
            ks = prompts[rng.randrange(len(prompts))]
            requested += len(ks)
            # Host-resident leading pages (cache mode only: buffer_only keeps none).
            n_host = 0
            while n_host < len(ks) and ks[n_host] in node.resident:
                seen.move_to_end(ks[n_host])
                got = node.worker.canonical(node.resident[ks[n_host]])
                wrong += not torch.equal(got, page_bytes(ks[n_host], node.page_size))
                n_host += 1
            rest = ks[n_host:]
            n_l3 = 0
            if rest:
                room(node, seen, len(rest))
                n_l3, idx = node.prefetch(rest)
                if n_l3 and idx is not None:
                    wrong += len(node.wrong_pages(rest, idx, n_l3))
                    if mode == "cache":
                        for i, k in enumerate(rest[:n_l3]):
                            node.keep(k, int(idx[i * PAGE]) // PAGE)
                            seen[k] = None
                    else:
                        node.release(idx)
            hits += n_host + n_l3
            computed = rest[n_l3:]
            if computed:
                room(node, seen, len(computed))
                node.backup(computed, batch=a.batch)
                for k in computed if mode == "cache" else ():
                    seen[k] = None
        given_up = sum(sum(n.counts.given_up.values()) for n in nodes)
        return {
            "mode": mode,
            "host_bytes": nodes[0].host_bytes,
            "peak_pages": max(n.counts.peak_host_pages for n in nodes),
            "host_pages": nodes[0].host.size // PAGE,
            "hit_rate": hits / requested,
            "wrong": wrong,
            "given_up": given_up,
        }
    finally:
        for n in nodes:
            n.close()


def room(node, seen: OrderedDict, pages: int) -> None:
    """cache mode: frees the oldest host-resident pages until ``pages`` fit."""
    from kvtier.testing.sglang_controller import PAGE

    while node.host.available_size() < pages * PAGE and seen:
        k, _ = seen.popitem(last=False)
        p = node.resident.pop(k)
        node.host.free(torch_range(p * PAGE, PAGE))


def torch_range(start: int, n: int):
    import torch

    return torch.arange(start, start + n, dtype=torch.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device-pages", type=int, default=32, help="device pool, pages")
    ap.add_argument("--cache-ratio", type=float, default=2.0, help="SGLang's cache default")
    ap.add_argument("--buffer-ratio", type=float, default=0.25)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--pages", type=int, default=6, help="pages per prompt")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4, help="pages per storage write")
    ap.add_argument("--layout", default="page_first_direct")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)

    from kvtier.testing.processes import Kvtierd
    from kvtier.testing.sglang_controller import single_rank

    rows = []
    with tempfile.TemporaryDirectory() as tmp, single_rank():
        for mode, ratio in (("cache", a.cache_ratio), ("buffer_only", a.buffer_ratio)):
            d = Kvtierd(Path(tmp) / mode)
            try:
                rows.append(run_mode(d.socket, mode, a, ratio))
            finally:
                d.stop()
    cache, buf = rows
    ratio = buf["host_bytes"] / cache["host_bytes"]
    print(
        f"{'mode':<12} {'host bytes/worker':>18} {'host pages':>10} {'peak in use':>11} "
        f"{'hit rate':>9} {'wrong':>6} {'given up':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<12} {r['host_bytes']:>18,} {r['host_pages']:>10} "
            f"{r['peak_pages']:>11} {r['hit_rate']:>9.3f} {r['wrong']:>6} {r['given_up']:>9}"
        )
    print(f"buffer_only / cache host bytes per worker: {ratio:.3f} (goal <= 0.25)")
    if not a.check:
        return 0
    failures = []
    if ratio > 0.25:
        failures.append(f"ratio {ratio:.3f} > 0.25")
    if cache["hit_rate"] != buf["hit_rate"]:
        failures.append(f"hit rates differ: {cache['hit_rate']} vs {buf['hit_rate']}")
    for r in rows:
        if r["wrong"] or r["given_up"]:
            failures.append(f"{r['mode']}: {r['wrong']} wrong, {r['given_up']} given up")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
