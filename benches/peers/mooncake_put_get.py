#!/usr/bin/env python3
"""Mooncake Store put/get of fixed-size pages, for kvtier's peer comparison.

One client process that also contributes its memory segment (as an inference worker would),
talking to a running mooncake_master over TCP on loopback. Prints one JSON object:
{"put_bytes_per_s": ..., "get_bytes_per_s": ...} (medians of the rounds).
"""

import argparse
import json
import os
import statistics
import sys
import time

from mooncake.store import MooncakeDistributedStore


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True, help="host:port of mooncake_master's RPC")
    ap.add_argument("--metadata", required=True, help="http://host:port/metadata")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=2 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    store = MooncakeDistributedStore()
    # The segment must hold every page of a round, or gets fail once it evicts.
    segment = max(1 << 30, 2 * a.pages * a.page_bytes)
    rc = store.setup("127.0.0.1", a.metadata, segment, 256 << 20, "tcp", "", a.master)
    if rc != 0:
        print(f"mooncake setup failed: {rc}", file=sys.stderr)
        return 1
    data = [os.urandom(a.page_bytes) for _ in range(a.pages)]
    puts, gets = [], []
    for r in range(a.rounds):
        keys = [f"r{r}-p{i}" for i in range(a.pages)]
        t = time.perf_counter()
        for k, d in zip(keys, data):
            if store.put(k, d) != 0:
                print(f"put {k} failed", file=sys.stderr)
                return 1
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for k, d in zip(keys, data):
            b = store.get(k)
            if len(b) != len(d):
                print(f"get {k}: {len(b)} bytes", file=sys.stderr)
                return 1
        gets.append(time.perf_counter() - t)
        for k in keys:
            store.remove(k)
    total = a.pages * a.page_bytes
    print(
        json.dumps(
            {
                "put_bytes_per_s": total / statistics.median(puts),
                "get_bytes_per_s": total / statistics.median(gets),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
