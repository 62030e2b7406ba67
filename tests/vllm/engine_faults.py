"""The faults the vLLM engine loop (``vllm_engine.py``) injects for the fuzzer and the
connector tests: into the agent calls (short loads, lost saves, a Load past its deadline
while kvtierd is stopped, saves held past a preemption, a call reported past its deadline),
memory pressure that makes vLLM preempt (``Squeeze``), and another request taking the
blocks vLLM frees and checking nobody wrote them meanwhile (``Reuse``). Each draws from one
seeded generator, so a schedule replays."""

from __future__ import annotations

import os
import time


class Faults:
    """Faults injected into the agent calls, each drawn from one seeded generator so a
    schedule replays: ``short_loads`` (the probability that a Load asks the agent for only
    some of its pages, as when pages left L2 between the lookup and the load: the blocks
    past them keep whatever their last owner wrote) and ``drop_saves`` (rank -> the
    probability that a SaveBatch of that TP rank's worker is lost before the agent sees it,
    so the ranks' agents hold different pages). ``fired`` counts each fault that happened."""

    def __init__(
        self,
        seed: int = 0,
        short_loads: float = 0.0,
        drop_saves: dict[int, float] | None = None,
        squeeze: bool = False,
        late_save: float = 0.0,
        aborts: float = 0.0,
        stall: int | None = None,
        block: int = 16,
    ):
        import random
        import threading

        # Tokens per block (vLLM's block size here).
        self.block = block
        self.rng = random.Random(seed)
        self.aborts = aborts
        # kvtierd (pid) stopped through the second Load's deadline; then whether that Load
        # failed and its request is still to be aborted.
        self.stall = stall
        self.stalled = False
        # Loads seen so far (the stall stops kvtierd through the second).
        self.loads = 0
        self.taken = threading.Event()
        self.short_loads = short_loads
        self.drop_saves = drop_saves or {}
        self.squeeze = Squeeze(block) if squeeze or late_save else None
        # Freed blocks taken by another request at once, wherever vLLM frees a running
        # request's blocks (preemptions, aborts).
        self.reuse = Reuse() if self.squeeze or aborts or stall else None
        self.late_save = late_save
        self.fired = {"short_load": 0, "drop_save": 0, "late_save": 0, "abort": 0, "stall": 0}
        # Agent socket -> the TP rank whose worker calls it.
        self.rank_of: dict[str, int] = {}

    def draw_aborts(self, req_ids: list[str], step: int) -> dict[str, int]:
        """Each request but the first is aborted with probability ``aborts``, before a step
        drawn among the next 40 (one that finished by then is not); the last one added
        always is, before the next step (while it waits), so that an abort asked for
        happens. The first runs to its end, so that a worker that saves saves something
        (the 30-minute run's seed 1338096775 aborted every request of a worker)."""
        out: dict[str, int] = {}
        if not self.aborts or len(req_ids) < 2:
            return out
        for rid in req_ids[1:]:
            if self.rng.random() < self.aborts:
                out[rid] = step + 1 + self.rng.randrange(40)
        out[req_ids[-1]] = step + 1
        return out

    def install(self) -> None:
        import threading

        import grpc

        from kvtier.agent import After, AgentClient, Loaded
        from kvtier.host import KvtierError

        lock = threading.Lock()
        load_pages, save_batch = AgentClient.load_pages, AgentClient.save_batch
        faults = self

        first: set[str] = set()

        def draw(kind: str, p: float) -> bool:
            """Whether this call meets the fault: always the first eligible one (a fault
            asked for happens), then with probability ``p``."""
            with lock:
                if p <= 0:
                    return False
                if kind not in first:
                    first.add(kind)
                    return True
                return faults.rng.random() < p

        def short(self, tokens, namespace, start, pages, *a, **k):
            if len(pages) > 1 and draw("short_load", faults.short_loads):
                with lock:
                    keep = faults.rng.randrange(len(pages))
                    faults.fired["short_load"] += 1
                if isinstance(tokens, After):
                    tokens = After(tokens.parent, list(tokens.tokens)[: keep * faults.block])
                else:
                    tokens = list(tokens)[: (start + keep) * faults.block]
                pages = list(pages)[:keep]
                if not pages:
                    return Loaded(0)
            return load_pages(self, tokens, namespace, start, pages, *a, **k)

        def lossy(self, *a, **k):
            rank = faults.rank_of.get(self.address, 0)
            if draw("drop_save", faults.drop_saves.get(rank, 0.0)):
                with lock:
                    faults.fired["drop_save"] += 1
                raise KvtierError("save_batch: lost (injected)", grpc.StatusCode.UNAVAILABLE)
            return save_batch(self, *a, **k)

        held = {"done": False}

        def late(self, *a, **k):
            """The first SaveBatch waits for vLLM's first preemption, then ``late_save``
            seconds more, and every later one waits behind it on the save thread: saves
            reading the preempted request's blocks (the one on the wire, and those queued)
            outlive the connector's wait for them, and vLLM reuses the blocks meanwhile."""
            with lock:
                first = not held["done"]
                held["done"] = True
            assert faults.squeeze is not None
            if first and faults.squeeze.preempted.wait(30):
                time.sleep(faults.late_save)
                with lock:
                    faults.fired["late_save"] += 1
            return inner_save(self, *a, **k)

        if self.short_loads:
            AgentClient.load_pages = short
        inner_load = AgentClient.load_pages

        def stalled(self, *a, **k):
            """The second Load finds kvtierd stopped (SIGSTOP, as a busy or swapped-out
            process is) until just past the call's deadline: the agent has read the Load and
            waits for kvtierd's pages while the worker reports the blocks failed, the
            harness aborts their request, and another takes its blocks (Reuse). Resumed,
            kvtierd answers an agent whose client left. Not the first Load: that one is
            usually the first request's, which the harness never aborts (so the abort this
            stall exists for would not happen: a run failed as vacuous in 1 of 3 tries)."""
            with lock:
                faults.loads += 1
                this = faults.loads == 2
                faults.fired["stall"] += this
            if not this:
                return inner_load(self, *a, **k)
            import signal as sig

            assert faults.stall is not None
            pid = faults.stall
            os.kill(pid, sig.SIGSTOP)
            # Resumed once the blocks are another's (every Load of the step failed first, 2 s
            # each), or short of the agent's own deadline for kvtierd's answer (the fuzzer
            # gives its agents daemon.timeout = 10 s where it stalls kvtierd).
            until = 8.0

            def resume() -> None:
                faults.taken.wait(until)
                os.kill(pid, sig.SIGCONT)

            threading.Thread(target=resume, daemon=True).start()
            try:
                return inner_load(self, *a, **k)
            finally:
                faults.stalled = True

        if self.stall:
            AgentClient.load_pages = stalled
        if self.drop_saves:
            AgentClient.save_batch = lossy
        inner_save = AgentClient.save_batch
        if self.late_save:
            AgentClient.save_batch = late


# How long blocks taken by Reuse stay another request's.
REUSE_HOLD_S = 1.0


class Reuse:
    """Another request taking the blocks vLLM frees: right after vLLM preempts or aborts a
    request (once the connector's hooks for the step ran), every free block is allocated
    and written with that other request's KV, and held for ``REUSE_HOLD_S`` (else a
    preempted request, resumed at once, gets its own blocks back and recomputes the same
    bytes into them). A save still reading a freed block then reads foreign bytes; a load
    still writing one (past its deadline, or for an aborted request) overwrites the other
    request's KV, which ``release`` finds: every held block must still hold what was
    written into it."""

    def __init__(self):
        self.held: list = []
        self.since = 0.0
        # Blocks taken, and (block, rank) pairs found overwritten while held.
        self.taken = 0
        self.overwritten: set[tuple[int, int]] = set()

    @staticmethod
    def _pattern(block: int) -> int:
        return (0x2A5A + 7 * block) & 0x7FFF

    def take(self, sched, kvs: list) -> None:
        pool = sched.kv_cache_manager.block_pool
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        for b in blocks:
            for kv in kvs:
                for a in kv.raw:
                    a[b.block_id] = self._pattern(b.block_id)
        if not self.held:
            self.since = time.monotonic()
        self.held += blocks
        self.taken += len(blocks)

    def release(self, sched, kvs: list, wait: bool = False) -> None:
        """The held blocks go back once held long enough (``wait``: after waiting for that),
        each checked."""
        if not self.held:
            return
        left = self.since + REUSE_HOLD_S - time.monotonic()
        if left > 0:
            if not wait:
                return
            time.sleep(left)
        for b in self.held:
            for kv in kvs:
                if any((a[b.block_id] != self._pattern(b.block_id)).any() for a in kv.raw):
                    self.overwritten.add((b.block_id, kv.rank))
        sched.kv_cache_manager.block_pool.free_blocks(self.held)
        self.held = []


class Squeeze:
    """Memory pressure that makes vLLM preempt, whatever the timing of loads: while a
    running request has a block boundary still ahead of it (16 tokens or more left to
    decode), every free block of the scheduler's pool is taken (as another request's
    allocation would), until the scheduler preempts a request to make room; then they come
    back. A small pool alone preempts or not depending on how loads and lookups interleave."""

    def __init__(self, block: int):
        import threading

        self.block = block
        self.held: list = []
        self.done = False
        # Set once the scheduler preempted a request.
        self.preempted = threading.Event()

    def before(self, sched) -> None:
        """Before a step is scheduled: takes the free blocks when a preemption must follow."""
        if self.done or self.held:
            return
        if any(r.max_tokens - r.num_output_tokens > self.block for r in sched.running):
            pool = sched.kv_cache_manager.block_pool
            self.held = pool.get_new_blocks(pool.get_num_free_blocks())

    def after(self, sched, so) -> None:
        """After it is scheduled: gives the blocks back once it preempted, or when nothing
        runs that could need a block."""
        if not self.held:
            return
        self.done = bool(so.preempted_req_ids)
        if self.done:
            self.preempted.set()
        if self.done or not sched.running:
            sched.kv_cache_manager.block_pool.free_blocks(self.held)
            self.held = []


def time_out_first(which: str) -> None:
    """The first agent Load (or Save) goes out for real on a thread of its own and is
    reported to the connector as past its deadline at once: the agent may still be copying
    in the staging pool when the connector moves on."""
    import threading

    import grpc

    from kvtier.agent import AgentClient
    from kvtier.host import KvtierError

    name = {"load": "load_pages", "save": "save_batch"}[which]
    real = getattr(AgentClient, name)
    fired = []

    def timed_out(self, *a, **k):
        if fired:
            return real(self, *a, **k)
        t = threading.Thread(target=lambda: _quietly(real, self, *a, **k), daemon=True)
        fired.append(t)
        t.start()
        raise KvtierError(
            f"{name}: deadline exceeded (injected)", grpc.StatusCode.DEADLINE_EXCEEDED
        )

    setattr(AgentClient, name, timed_out)


def _quietly(fn, *a, **k):
    try:
        fn(*a, **k)
    except Exception:  # noqa: BLE001 - the late call's outcome is the test's to observe
        pass
