"""SGLang's zero-copy storage calls through kvtier, against a memcpy of the same bytes.

    KVTIERD_BIN=target/release/kvtierd python benches/sglang_v1.py [--layers 32] [--pages 32]

A real SGLang host pool (``MHATokenToKVPoolHost``, CPU) and kvtier.sglang.KvtierStorage loaded
by SGLang's storage factory, against a real kvtierd. For each layout it times
``batch_set_v1`` of new pages (Reserve, copy into the shared pool, Commit) and
``batch_get_v1`` of pages in L2 (Acquire, copy out, Release), and prints each as a ratio to
numpy copying the same number of bytes between two warm buffers in the same run (the
machine is shared and noisy: only ratios compare across runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--pages", type=int, default=32, help="pages per call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="kvtierd settings (key=value)")
    a = ap.parse_args()

    import kvtier.testing.sglang as sp

    sp.PAGE, sp.LAYERS = a.page, a.layers
    page_bytes = 2 * a.layers * a.page * a.heads * a.head_dim * 2
    batch = a.pages * page_bytes
    d = sp.Kvtierd(
        Path(tempfile.mkdtemp(prefix="kvtier-bench-")),
        f"l2.pool_bytes={4 * batch + (64 << 20)}",
        "l3.backend=none",
        *a.set,
    )
    src = np.random.default_rng(1).integers(0, 255, batch, dtype=np.uint8)
    dst = np.empty_like(src)
    print(f"page {page_bytes / 2**20:.1f} MiB, {a.pages} pages per call ({batch / 2**20:.0f} MiB)")
    print(
        f"{'layout':<18} {'memcpy GB/s':>11} {'set GB/s':>9} {'set/memcpy':>10} "
        f"{'get GB/s':>9} {'get/memcpy':>10}"
    )
    try:
        for layout in sp.LAYOUTS:
            w = sp.worker(
                d.socket, layout, heads=a.heads, head_dim=a.head_dim, tokens=4 * a.pages * a.page
            )
            w.kv.view(-1).view(dtype=torch.uint8).random_(0, 255)
            mem, put, get = [], [], []
            for r in range(a.rounds + 1):
                t = time.perf_counter()
                np.copyto(dst, src)
                mem.append(time.perf_counter() - t)
                ks = sp.keys(a.pages, salt=f"{layout}-{r}")
                t = time.perf_counter()
                ok = w.backend.batch_set_v1(ks, w.indices(0, a.pages))
                put.append(time.perf_counter() - t)
                assert all(ok), ok
                t = time.perf_counter()
                ok = w.backend.batch_get_v1(ks, w.indices(a.pages, a.pages))
                get.append(time.perf_counter() - t)
                assert all(ok), ok
            # The first round faults the shared pool's pages in: left out.
            m, p, g = (statistics.median(x[1:]) for x in (mem, put, get))
            gbs = batch / 1e9
            print(
                f"{layout:<18} {gbs / m:>11.2f} {gbs / p:>9.2f} {m / p:>10.2f} "
                f"{gbs / g:>9.2f} {m / g:>10.2f}"
            )
            w.close()
    finally:
        d.stop()


if __name__ == "__main__":
    main()
