"""The scheduler side's lookups in flight: a few threads that send them, each with its own
deadline, behind a breaker, and what each brings back.

vLLM asks about a waiting request once per scheduling pass until it is answered, so the
question "is its lookup back yet?" is asked many times per request on vLLM's scheduler
thread. It is an attribute read here (:attr:`PendingLookup.done`): no future, no lock, no
allocation, nothing that can hand the GIL to another thread in the middle of the pass.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.host import KvtierError

T = TypeVar("T")


class LookupBreaker:
    """Whether to ask the agent at all: after a lookup timed out or found the agent gone,
    none is sent for ``pause_s`` and every request is answered "nothing cached" at once,
    so a hung agent costs one lookup deadline, not one per waiting request. Lookups run
    on several threads meanwhile, so one slow answer holds up no other."""

    def __init__(self, pause_s: float):
        self.pause_s = pause_s
        self._open_until = 0.0
        self._lock = threading.Lock()

    def is_open(self, now: float) -> bool:
        return now < self._open_until

    def failed(self, e: KvtierError) -> None:
        """A lookup failed; one that timed out or could not reach the agent opens it."""
        if e.timed_out or e.retryable:
            with self._lock:
                self._open_until = time.monotonic() + self.pause_s


class PendingLookup(Generic[T]):
    """One lookup, from when it is queued until its answer is read: pages ``start`` to
    ``limit`` of a request. A lookup thread fills in ``result`` or ``error`` and then sets
    ``done``; the scheduler thread reads ``done`` first, so it never sees half an answer."""

    __slots__ = (
        "start",
        "limit",
        "started",
        "done_at",
        "done",
        "dropped",
        "reported",
        "result",
        "error",
    )

    def __init__(self, start: int, limit: int, now: float):
        self.start, self.limit, self.started = start, limit, now
        # When the scheduler first saw the answer (0: not yet).
        self.done_at = 0.0
        self.done = False
        # Given up by the scheduler before a thread took it: it is not sent.
        self.dropped = False
        # Its failure was logged (vLLM may ask about the request again for a while).
        self.reported = False
        self.result: T | None = None
        self.error: BaseException | None = None


class LookupThreads:
    """``threads`` threads that run queued lookups, started at once (the standard
    executor starts one per submit until it has them all, and each start cost vLLM's
    scheduler thread 1-1.7 ms, measured on 2 cores). Queuing one is a put on a C queue."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.SimpleQueue[
            tuple[PendingLookup, Callable[..., object], tuple[object, ...]] | None
        ] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        # Each start returns once its thread runs.
        for t in self._threads:
            t.start()

    def submit(self, pending: PendingLookup[T], run: Callable[..., T], *args: object) -> None:
        """Queues ``run(*args)``, whose result or error ``pending`` receives."""
        self._queue.put((pending, run, args))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, run, args = item
            if pending.dropped:
                continue
            try:
                pending.result = run(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                pending.error = e
            pending.done = True

    def shutdown(self) -> None:
        """Stops the threads once each has finished the lookup it is sending; queued ones
        are not sent."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].dropped = True
        for _ in self._threads:
            self._queue.put(None)
