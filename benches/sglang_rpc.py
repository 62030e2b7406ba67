"""SGLang's HiCache RPC protocol through kvtierd, against a memcpy of the same bytes.

    KVTIERD_BIN=target/release/kvtierd python benches/sglang_rpc.py [--pages 32]

The client does what SGLang's RPC storage client does (tests/sglang/hicache_rpc.py): it
registers a memfd host pool over the mempool socket, then ``BatchPut`` of new objects and
``BatchGet`` of objects in L2, each object one page as SGLang's ``page_first`` pool lays it
out (its K and V halves at separate offsets: two iovecs). kvtierd copies between the memfd
and its memory of SGLang objects (``sglang_rpc.l3 = "none"``, so no L3 write is timed);
page bytes never travel over gRPC. Each figure is printed as
a ratio to numpy copying the same number of bytes between two warm buffers in the same run.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-mib", type=int, default=8, help="bytes of one object (MiB)")
    ap.add_argument("--pages", type=int, default=32, help="objects per call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="kvtierd settings (key=value)")
    a = ap.parse_args()

    from kvtier.testing import Kvtierd
    from kvtier.testing import hicache_rpc as rpc

    page = a.page_mib << 20
    half = page // 2
    batch = a.pages * page
    data = Path(tempfile.mkdtemp(prefix="kvtier-bench-rpc-"))
    d = Kvtierd(
        data,
        "sglang_rpc.enable=true",
        # Objects live in kvtierd's memory only (no L3): two calls' worth, so from the third
        # round on each put reuses the buffers of objects pushed out, as in a steady state.
        "sglang_rpc.l3=none",
        f"sglang_rpc.memory_bytes={2 * batch}",
        "l3.backend=none",
        *a.set,
    )
    pool = rpc.HostPool(2 * batch)
    # Fault the client's pool in and fill it, as SGLang's host pool is before it is used.
    view = mmap.mmap(pool.fd, 2 * batch)
    view[:batch] = np.random.default_rng(1).integers(0, 255, batch, dtype=np.uint8).tobytes()
    c = rpc.Client(str(data / "sglang-mempool.sock"), str(data / "sglang-grpc.sock"), pool)
    src = np.random.default_rng(2).integers(0, 255, batch, dtype=np.uint8)
    dst = np.empty_like(src)

    def objects(region: int, r: int):
        # K halves of all pages first, then the V halves (page_first: [2][tokens][...]).
        base = region * batch
        return [
            c.transfer(
                f"bench-{r}-{i}",
                [(base + i * half, half), (base + a.pages * half + i * half, half)],
            )
            for i in range(a.pages)
        ]

    print(f"object {a.page_mib} MiB in 2 iovecs, {a.pages} per call ({batch >> 20} MiB)")
    mem, put, get = [], [], []
    try:
        for r in range(a.rounds + 2):
            t = time.perf_counter()
            np.copyto(dst, src)
            mem.append(time.perf_counter() - t)
            t = time.perf_counter()
            res = c.batch_put(objects(0, r))
            put.append(time.perf_counter() - t)
            assert res == [0] * a.pages, res
            t = time.perf_counter()
            res = c.batch_get(objects(1, r))
            get.append(time.perf_counter() - t)
            assert res == [0] * a.pages, res
        # Spot check: the last object read back is the bytes written.
        assert view[batch : batch + 4096] == view[:4096]
        # The first two rounds fault kvtierd's buffers in: left out.
        m, p, g = (statistics.median(x[2:]) for x in (mem, put, get))
        gbs = batch / 1e9
        print(
            f"{'memcpy GB/s':>11} {'put GB/s':>9} {'put/memcpy':>10} "
            f"{'get GB/s':>9} {'get/memcpy':>10}"
        )
        print(f"{gbs / m:>11.2f} {gbs / p:>9.2f} {m / p:>10.2f} {gbs / g:>9.2f} {m / g:>10.2f}")
    finally:
        c.close()
        view.close()
        pool.close()
        d.stop()


if __name__ == "__main__":
    main()
