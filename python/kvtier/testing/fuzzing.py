"""The command line both engine fuzzers share (tests/vllm/fuzz.py, tests/sglang/sglang_fuzz.py):
replay given seeds, or run random ones for as long as asked, then print (and optionally
write) what they went through, in total and per second. A failing seed is printed with the
command that replays it."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path


def main(
    description: str,
    script: str,
    fuzz_one: Callable[[int], dict],
    events: Callable[[dict], dict[str, float]],
) -> int:
    """Runs the fuzzer whose ``fuzz_one(seed)`` returns a report with its ``problems``
    (empty: the schedule passed); ``events(report)`` are the figures summed over the run.
    ``script``: the fuzzer's path, for the replay command. The exit status: 1 if any seed
    failed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seed", type=int, action="append", help="replay these schedules")
    ap.add_argument("--minutes", type=float, help="run random schedules this long")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args()
    seeds = list(a.seed or [])
    t0 = time.monotonic()
    total: dict[str, float] = {}
    failed: list[int] = []
    done = 0
    rng = random.Random()
    while True:
        if seeds:
            seed = seeds.pop(0)
        elif a.minutes is not None and time.monotonic() - t0 < a.minutes * 60:
            seed = rng.randrange(1 << 31)
        else:
            break
        report = fuzz_one(seed)
        done += 1
        for k, v in events(report).items():
            total[k] = total.get(k, 0) + v
        if report["problems"]:
            failed.append(seed)
            print(f"FAILED seed {seed} (replay: python {script} --seed {seed})")
            for p in report["problems"]:
                print(f"  {p}")
    secs = time.monotonic() - t0
    summary = {
        "schedules": done,
        "failed_seeds": failed,
        "seconds": round(secs, 1),
        "per_second": {k: round(v / secs, 2) for k, v in total.items()},
        **total,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary))
    return 1 if failed else 0
