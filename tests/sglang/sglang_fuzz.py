"""The SGLang HiCache fuzzer: seeded random schedules of SGLang instances against a real
kvtierd, every page checked against an oracle that recomputes everything.

Each instance is every TP rank's kvtier backend, loaded by SGLang 0.5.23's own storage
factory over SGLang's own host pools (``kvtier.testing.sglang.worker``), driven as SGLang's
cache controller drives it: ``batch_exists`` over a request's page keys (the smallest hit of
the TP ranks, as SGLang all-reduces it), ``batch_get_v1`` of the hit into free host pages
(the ranks' shortest leading run of successes is what the request keeps), the forward pass
over the rest, then ``batch_set_v1`` of the pages it computed, on a backup thread of its own
as SGLang's controller runs backups (several in flight behind the requests).

The stand-in forward pass reads its context as attention does: page i's KV on every rank is
a function of its tokens, the weights and a digest of **the bytes in the host pages** of
pages 0..i-1 of every rank (the all-reduce mixes the ranks; MLA ranks hold one latent).
A page loaded stale or foreign makes every page computed over it wrong, on every rank, and
those go to kvtierd under the right keys. Every page a get brings back and every page
computed is compared with the oracle's recomputation from scratch.

A schedule (:func:`make_schedule`, a pure function of its seed) draws MHA or MLA, TP 1 or 2,
each rank's host layout (``layer_first``, ``page_first``, ``page_first_direct``; ranks and
restarts differ), the L2 pool's size (small: pages go through L3), slow L3 reads and writes,
and 3 to 5 instances one after another (restarts: new backends, new pools) continuing earlier
conversations and starting new ones, each with faults: one rank's backups lost (the ranks'
stores disagree), a weight update (SGLang's flush, which ends the backups in flight, new
weights, then ``clear()``), a plain ``clear()`` racing queued backups (same weights),
kvtierd stopped (SIGSTOP) or killed (restarted on its directory) mid-run. The last instance
reads back every conversation. A schedule fails on any wrong page and on a vacuous run (the
last instance loads nothing though pages were stored; a drawn fault that never happened).
A failing seed replays::

    python tests/sglang/sglang_fuzz.py --seed 17
    python tests/sglang/sglang_fuzz.py --minutes 30
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.testing import fuzzing
from kvtier.testing.sglang import LAYOUTS, PAGE, Kvtierd, Worker, worker

FAULTS = ("drop_sets", "weight_update", "clear", "daemon_stop", "daemon_kill")
# Host pages per rank (the pool's 2048 tokens); a request uses at most 16.
HOST_PAGES = 2048 // PAGE


@dataclass
class Instance:
    """One SGLang instance (a start or a restart) of a schedule."""

    name: str
    layouts: list[str]
    prompts: list[list[int]]
    faults: list[str] = field(default_factory=list)
    # Before this request: the fault's moment.
    at: dict[str, int] = field(default_factory=dict)
    drop: tuple[int, float] | None = None
    daemon_secs: float = 1.0


@dataclass
class Schedule:
    seed: int
    mla: bool
    tp: int
    l2_pages: int
    l3_delay: str | None
    instances: list[Instance]

    def describe(self) -> str:
        parts = [
            f"seed {self.seed}: {'mla' if self.mla else 'mha'}, tp {self.tp}, "
            f"L2 {self.l2_pages} pages, L3 delay {self.l3_delay}"
        ]
        for i in self.instances:
            parts.append(f"{i.name} {i.layouts} {len(i.prompts)} requests {i.faults} {i.at}")
        return "\n  ".join(parts)


def make_schedule(seed: int) -> Schedule:
    """The schedule of ``seed``: the same every time."""
    rng = random.Random(seed)
    mla = rng.random() < 0.3
    tp = rng.choice([1, 2])
    l2_pages = rng.choice([64, 256, 2048])
    l3_delay = rng.choice([None, None, "50ms", "400ms"])
    systems = [
        [rng.randrange(50_000) for _ in range(PAGE * rng.randrange(2, 6))]
        for _ in range(rng.randrange(2, 4))
    ]
    live: list[list[int]] = []
    instances = []
    for n in range(rng.randrange(3, 6)):
        prompts = []
        for _ in range(rng.randrange(3, 7)):
            turn = [rng.randrange(50_000) for _ in range(PAGE * rng.randrange(1, 6))]
            prompts.append(rng.choice(systems) + turn)
        for p in rng.sample(live, min(len(live), rng.randrange(1, 4))):
            prompts.append(p + [rng.randrange(50_000) for _ in range(PAGE * rng.randrange(1, 4))])
        prompts = [p[: 16 * PAGE] for p in prompts]
        rng.shuffle(prompts)
        live += prompts
        inst = Instance(f"i{n}", [rng.choice(LAYOUTS) for _ in range(tp)], prompts)
        for f in rng.sample(FAULTS, rng.randrange(0, 3)) if n else []:
            if f == "drop_sets" and tp < 2:
                continue
            # One disturbance of kvtierd per instance.
            if f.startswith("daemon") and any(g.startswith("daemon") for g in inst.faults):
                continue
            inst.faults.append(f)
            inst.at[f] = rng.randrange(1, len(prompts))
            if f == "drop_sets":
                inst.drop = (rng.randrange(tp), rng.choice([0.4, 0.8]))
            if f.startswith("daemon"):
                inst.daemon_secs = rng.choice([0.5, 1.5])
        instances.append(inst)
    instances.append(Instance("check", [rng.choice(LAYOUTS) for _ in range(tp)], list(live)))
    return Schedule(seed, mla, tp, l2_pages, l3_delay, instances)


class Oracle:
    """The stand-in forward pass, and the oracle that runs it from scratch."""

    def __init__(self, mla: bool, tp: int, page_bytes: int):
        self.mla, self.tp, self.page_bytes = mla, tp, page_bytes

    def page(self, context: bytes, tokens: list[int], rank: int) -> torch.Tensor:
        """Page KV (kvtier's byte order) of ``tokens`` on ``rank``, over ``context``."""
        seed = hashlib.sha256(
            context + np.asarray(tokens, dtype="<u4").tobytes() + bytes([0 if self.mla else rank])
        ).digest()
        raw = np.random.default_rng(int.from_bytes(seed[:8], "little")).bytes(self.page_bytes)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @staticmethod
    def step(context: bytes, ranks_pages: list[torch.Tensor]) -> bytes:
        """The context after one more page: a digest of every rank's bytes of it."""
        h = hashlib.sha256(context)
        for t in ranks_pages:
            h.update(t.numpy().tobytes())
        return h.digest()

    def expected(self, weights: bytes, tokens: list[int]) -> list[list[torch.Tensor]]:
        """Every page of a request on every rank, recomputed from scratch."""
        out, ctx = [], weights
        for i in range(len(tokens) // PAGE):
            pages = [self.page(ctx, tokens[i * PAGE : (i + 1) * PAGE], r) for r in range(self.tp)]
            out.append(pages)
            ctx = self.step(ctx, pages)
        return out


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's page keys: a chain of hex SHA-256 digests over the pages' tokens."""
    out, prev = [], b""
    for i in range(len(tokens) // PAGE):
        page = np.asarray(tokens[i * PAGE : (i + 1) * PAGE], dtype="<u4").tobytes()
        prev = hashlib.sha256(prev + page).digest()
        out.append(prev.hex())
    return out


class Engine:
    """One instance: its TP ranks' backends and host pools, its weights, its backups."""

    def __init__(self, s: Schedule, inst: Instance, socket: str, oracle: Oracle, seed: str):
        self.ranks: list[Worker] = [
            worker(
                socket,
                layout,
                mla=s.mla,
                tp_rank=r,
                tp_size=s.tp,
                timeout_s=2.0,
                reconnect_interval_s=0.1,
            )
            for r, layout in enumerate(inst.layouts)
        ]
        self.inst, self.oracle, self.seed = inst, oracle, seed
        self.weights = b"weights"
        self.next_page = 0
        self.backups: deque[threading.Thread] = deque()
        self.wrong: list[str] = []
        self.counts = {"requests": 0, "loaded": 0, "computed": 0, "set": 0, "dropped": 0}
        self._counting = threading.Lock()

    def close(self) -> None:
        self.flush()
        for w in self.ranks:
            w.close()

    def flush(self) -> None:
        """Waits for every backup in flight (SGLang's flush before a weight update)."""
        while self.backups:
            self.backups.popleft().join()

    def _alloc(self, n: int) -> int:
        """Free host pages for a request: a ring; older backups are waited for first."""
        while len(self.backups) > 2:
            self.backups.popleft().join()
        if self.next_page + n > HOST_PAGES:
            self.next_page = 0
        at = self.next_page
        self.next_page += n
        return at

    def serve(self, req: int, tokens: list[int]) -> None:
        ks = page_keys(tokens)
        n = len(ks)
        if n == 0:
            return
        base = self._alloc(n)
        self.counts["requests"] += 1
        want = self.oracle.expected(self.weights, tokens)
        hit = min(w.backend.batch_exists(ks) for w in self.ranks)
        loaded = 0
        if hit:
            got = [w.backend.batch_get_v1(ks[:hit], w.indices(base, hit)) for w in self.ranks]
            loaded = min(_leading(g) for g in got)
        # Every page a get brought back (on each rank, past the kept prefix too) is right.
        for r, w in enumerate(self.ranks):
            for i in range(loaded):
                if not torch.equal(w.canonical(base + i), want[i][r]):
                    self.wrong.append(f"req {req} page {i} rank {r}: loaded wrong")
        self.counts["loaded"] += loaded
        # The forward pass over the rest, reading its context from the host pages.
        ctx = self.weights
        for i in range(n):
            if i >= loaded:
                chunk = tokens[i * PAGE : (i + 1) * PAGE]
                for r, w in enumerate(self.ranks):
                    w.put_canonical(base + i, self.oracle.page(ctx, chunk, r))
            pages = [w.canonical(base + i) for w in self.ranks]
            if i >= loaded:
                for r in range(len(self.ranks)):
                    if not torch.equal(pages[r], want[i][r]):
                        self.wrong.append(f"req {req} page {i} rank {r}: computed wrong")
            ctx = self.oracle.step(ctx, pages)
        self.counts["computed"] += n - loaded
        if loaded < n:
            args = (req, ks, base, loaded, n)
            t = threading.Thread(target=self._backup, args=args, daemon=True)
            t.start()
            self.backups.append(t)

    def _backup(self, req: int, ks: list[str], base: int, loaded: int, n: int) -> None:
        """SGLang's backup thread: every rank stores the pages the request computed (a
        dropping rank loses them, drawn per request so that a seed replays)."""
        drop = random.Random(f"{self.seed}-{req}").random()
        for r, w in enumerate(self.ranks):
            if self.inst.drop and self.inst.drop[0] == r:
                with self._counting:
                    # The first backup the fault can meet always meets it (a run that
                    # draws a fault sees it).
                    if not self.counts["dropped"] or drop < self.inst.drop[1]:
                        self.counts["dropped"] += n - loaded
                        continue
            ok = w.backend.batch_set_v1(ks[loaded:], w.indices(base + loaded, n - loaded))
            with self._counting:
                self.counts["set"] += sum(ok)


def _leading(oks: list[bool]) -> int:
    n = 0
    while n < len(oks) and oks[n]:
        n += 1
    return n


class _Disturbed:
    """kvtierd stopped (SIGSTOP) or killed for ``secs``, then resumed or restarted on its
    directory, while the instance goes on (its calls miss within their timeout)."""

    def __init__(self, d: Kvtierd, kind: str, secs: float):
        self.d, self.kind = d, kind
        if kind == "stop":
            os.kill(d.proc.pid, signal.SIGSTOP)
        else:
            d.kill()
        self.thread = threading.Thread(target=self._end, args=(secs,), daemon=True)
        self.thread.start()

    def _end(self, secs: float) -> None:
        time.sleep(secs)
        if self.kind == "stop":
            os.kill(self.d.proc.pid, signal.SIGCONT)
        else:
            self.d.start()

    def join(self) -> None:
        self.thread.join(60)


def run_schedule(s: Schedule, tmp: Path, log=print) -> dict:
    sets = [f"l2.pool_pages={s.l2_pages}"]
    if s.l3_delay:
        sets += [f"l3.fault_get_delay={s.l3_delay}", f"l3.fault_set_delay={s.l3_delay}"]
    d = Kvtierd(tmp / "kvtierd", *sets)
    problems: list[str] = []
    runs = []
    oracle: Oracle | None = None
    stored_before = 0
    disturbed: _Disturbed | None = None
    try:
        for k, inst in enumerate(s.instances):
            t0 = time.monotonic()
            eng = Engine(s, inst, d.socket, oracle or Oracle(s.mla, s.tp, 0), f"{s.seed}-{k}")
            if oracle is None:
                oracle = Oracle(s.mla, s.tp, eng.ranks[0].canonical(0).numel())
                eng.oracle = oracle
            fired: dict[str, bool] = {f: False for f in inst.faults}
            for i, tokens in enumerate(inst.prompts):
                for f in inst.faults:
                    if inst.at[f] != i:
                        continue
                    fired[f] = True
                    if f == "weight_update":
                        # SGLang's flush ends the backups in flight, then new weights and
                        # the storage cleared (a new epoch on every rank).
                        eng.flush()
                        eng.weights = hashlib.sha256(eng.weights + b"update").digest()
                        for w in eng.ranks:
                            w.backend.clear()
                    elif f == "clear":
                        # Same weights: a clear racing backups still queued is harmless.
                        for w in eng.ranks:
                            w.backend.clear()
                    elif f.startswith("daemon"):
                        disturbed = _Disturbed(d, f.removeprefix("daemon_"), inst.daemon_secs)
                eng.serve(i, tokens)
            if "drop_sets" in inst.faults:
                eng.flush()
                fired["drop_sets"] = eng.counts["dropped"] > 0
            eng.close()
            if disturbed is not None:
                disturbed.join()
                disturbed = None
            c = dict(eng.counts, seconds=round(time.monotonic() - t0, 1))
            runs.append(c)
            if eng.wrong:
                problems.append(f"{inst.name}: {len(eng.wrong)} wrong pages: {eng.wrong[:5]}")
            if inst.name == "check" and stored_before and not c["loaded"]:
                problems.append(f"{inst.name}: vacuous: loaded nothing")
            for f, seen in fired.items():
                if not seen:
                    problems.append(f"{inst.name}: vacuous: fault {f} never happened")
            stored_before += c["set"]
            log(f"  {inst.name} {inst.layouts} {inst.faults}: {c}")
    finally:
        # A restart still to come would outlive the schedule.
        if disturbed is not None:
            disturbed.join()
        d.stop()
    return {"runs": runs, "problems": problems}


def fuzz_one(seed: int, tmp: Path | None = None, log=print) -> dict:
    s = make_schedule(seed)
    log(s.describe())
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix=f"kvtier-sglang-fuzz-{seed}-") as t:
            return run_schedule(s, Path(t), log)
    return run_schedule(s, tmp, log)


def events(report: dict) -> dict[str, float]:
    """What a schedule's instances went through, summed."""
    out: dict[str, float] = {}
    for r in report["runs"]:
        for k, v in r.items():
            if k != "seconds":
                out[k] = out.get(k, 0) + v
    return out


def main() -> int:
    return fuzzing.main(__doc__.split("\n\n")[0], "tests/sglang/sglang_fuzz.py", fuzz_one, events)


if __name__ == "__main__":
    sys.exit(main())
