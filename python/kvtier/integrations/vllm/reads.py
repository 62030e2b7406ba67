"""The one rule for when a vLLM worker's saves may still read a request's blocks, the same
for every transfer (transfer.py, staged.py).

A save handed to the save thread after the step (DMA: the agent's copies; CPU staging: the
save thread's gather) reads its request's blocks later than the step. vLLM may reuse those
blocks once the request is preempted or finished, so:

- a finished request's blocks are held until no save reads them (:meth:`BlockReads.unread`,
  reported by ``get_finished``);
- a preemption waits for the saves still to read them, up to the agent calls' deadline
  (:meth:`BlockReads.give_up`); past it, the saves not yet begun skip that request, and
  one in the middle of reading is stopped (a DMA call cancelled) or waited for (a memcpy).

A save that reads its blocks within the step (GPU staging: the gather is ordered on the
step's stream) never holds or waits here; it only counts as pending for ``drain``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvtier.integrations.vllm.common import Job
    from kvtier.integrations.vllm.stats import Tally

logger = logging.getLogger("kvtier.vllm")

U = TypeVar("U")


class BlockReads:
    """Which requests' blocks saves handed to the save thread will still read, numbered in
    batches (one a step), and the preemptions that gave up waiting for them."""

    def __init__(self, timeout_s: float, tally: Tally):
        self.timeout_s = timeout_s
        self._tally = tally
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Saves still to read their blocks, by request.
        self._saving: dict[str, int] = {}
        # Requests whose preemption gave up waiting for their saves, with the last batch
        # given up (reads of it and earlier skip them; later batches are the resumed
        # request's own).
        self._abandoned: dict[str, int] = {}
        # The number of the next batch of saves.
        self._batches = 0
        # The requests whose blocks are being read now, and the agent call reading them
        # (DMA: a preemption that gives up on it cancels it).
        self._reading: set[str] = set()
        self._call: str | None = None
        # Saves handed to the save thread and not yet done; pages queued and not yet read
        # (CPU staging's backpressure).
        self.pending = 0
        self.queued = 0

    # ------------------------------------------------------------ the step's thread

    def admit(
        self,
        jobs: Sequence[Job],
        pages: int,
        room: Callable[[BlockReads], bool],
        queued: int,
        why: str,
    ) -> int | None:
        """Waits up to ``timeout_s`` for ``room(self)``, then numbers the step's batch of
        saves, marks its jobs as reading their blocks and adds ``queued`` pages still to
        read. None when no room came: the step's ``pages`` are dropped, counted
        (``save_dropped_pages``)."""
        with self._lock:
            if self._changed.wait_for(lambda: room(self), timeout=self.timeout_s):
                self.queued += queued
                for j in jobs:
                    self._saving[j.req_id] = self._saving.get(j.req_id, 0) + 1
                self.pending += 1
                batch = self._batches
                self._batches += 1
                return batch
        self._tally.count(save_dropped_pages=pages)
        logger.warning("kvtier: %d pages not saved: %s after %.1f s", pages, why, self.timeout_s)
        return None

    def handed_over(self) -> None:
        """A save that read its blocks within the step is handed to the save thread."""
        with self._lock:
            self.pending += 1

    # ------------------------------------------------------------ the save thread

    def start_reading(
        self, items: list[tuple[Job, U]], batch: int, call: str | None = None
    ) -> tuple[list[tuple[Job, U]], list[tuple[Job, U]]]:
        """Before the save thread reads batch ``batch``'s blocks (a gather, or the agent's
        copies in call ``call``): the items to read, and those given up because their
        request's preemption stopped waiting (their blocks may hold another request's KV
        by now; counted, ``save_preempted_pages``). Decided under one lock with the reading
        marked: a preemption that gives up after this waits until :meth:`end_reading`, or
        stops the call."""
        with self._lock:
            keep, gone = [], []
            for item in items:
                (gone if self._abandoned.get(item[0].req_id, -1) >= batch else keep).append(item)
            self._reading = {j.req_id for j, _ in keep}
            self._call = call
        if gone:
            self._tally.count(save_preempted_pages=sum(len(j.blocks) for j, _ in gone))
        return keep, gone

    def end_reading(self) -> None:
        with self._lock:
            self._reading = set()
            self._call = None
            self._changed.notify_all()

    def read(self, jobs: Sequence[Job], queued: int = 0) -> None:
        """These saves are past their blocks, which vLLM may reuse now; ``queued`` of
        their pages are no longer waiting to be read."""
        with self._lock:
            self.queued -= queued
            for job in jobs:
                left = self._saving.get(job.req_id, 1) - 1
                if left:
                    self._saving[job.req_id] = left
                else:
                    self._saving.pop(job.req_id, None)
                    self._abandoned.pop(job.req_id, None)
            self._changed.notify_all()

    def done(self) -> None:
        """A save handed to the save thread has ended."""
        with self._lock:
            self.pending -= 1
            self._changed.notify_all()

    # ------------------------------------------------------------ vLLM's calls

    def unread(self, requests: set[str]) -> set[str]:
        """Those of ``requests`` whose blocks no save still reads."""
        with self._lock:
            return {r for r in requests if not self._saving.get(r)}

    def give_up(self, preempted: Sequence[str], stop: Callable[[str], bool]) -> None:
        """Before a step reuses preempted requests' blocks: waits for the saves still to
        read them, up to ``timeout_s`` + 1 s. Past it the step goes on: saves not yet
        begun skip those requests (:meth:`start_reading`), and one reading them now ends
        first: ``stop(call)`` stops the agent call reading them (DMA; True once its copies
        stopped); else (a memcpy, or the stop failed) this waits for the read to end."""
        deadline = time.monotonic() + self.timeout_s + 1.0
        with self._lock:
            while any(self._saving.get(r) for r in preempted):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("kvtier: saves of preempted requests still running")
                    late = {r for r in preempted if self._saving.get(r)}
                    for r in late:
                        self._abandoned[r] = self._batches - 1
                    if not self._reading & late:
                        return
                    call = self._call
                    break
                self._changed.wait(left)
            else:
                return
        if call is not None and stop(call):
            return
        with self._lock:
            while self._reading & late:
                self._changed.wait()

    def drain(self, timeout: float) -> bool:
        """Waits for the saves handed to the save thread; True when none is left."""
        with self._lock:
            return self._changed.wait_for(lambda: self.pending == 0, timeout=timeout)
