"""How a vLLM worker's blocks move to and from its kvtier-agent: one interface,
:class:`Transfer` (load, save, stop a read, shut down), chosen once when vLLM registers its
KV cache (worker.py), with three implementations:

- :class:`DmaTransfer` (here): the agent maps vLLM's KV cache (CUDA IPC handles; on CPU,
  shared memory by descriptor) and copies blocks itself; saves run on the save thread once
  the step's writes are done;
- ``CpuStaging`` and ``GpuStaging`` (staged.py): the worker copies blocks through a
  shared-memory pool the agent maps; on CPU the save thread gathers after the step, on a GPU
  the step's stream gathers within the step.

Whether a save may still read a request's blocks is decided in one place for all three
(reads.py's :class:`BlockReads`)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvtier.agent import AgentClient, Saved, SaveItem
from kvtier.host import KvtierError
from kvtier.integrations.vllm.blocks import BlockBytes, cpu_export, cuda_export, pieces
from kvtier.v1 import common_pb2

if TYPE_CHECKING:
    from kvtier.integrations.vllm.common import Job, Settings
    from kvtier.integrations.vllm.reads import BlockReads
    from kvtier.integrations.vllm.staging import Staging
    from kvtier.integrations.vllm.stats import Tally

logger = logging.getLogger("kvtier.vllm")

T = TypeVar("T")

# DMA: steps whose saves may wait for the save thread at once.
DMA_QUEUE = 8
# DMA: how long one Cancel of a failed load may take (the agent waits up to 2 s for a copy
# part to stop), and the pause between Cancels while the agent does not answer.
SETTLE_CALL_S = 3.0
SETTLE_PAUSE_S = 0.2
# How long a copy part a running agent was in the middle of may take to end (the agent's own
# bound for a Cancel: a part is at most 256 KiB per CPU copy thread, 64 MiB on a GPU stream).
SETTLE_PART_S = 2.0
# How often a load still waiting for its copies to stop is logged again.
SETTLE_LOG_S = 10.0


@dataclass
class KvBlocks:
    """vLLM's KV cache as the worker registered it: its tensors, each layer's geometry and
    its blocks in kvtier's byte order (blocks.py), and the layout registered for it."""

    tensors: list[torch.Tensor]
    geometry: list[BlockBytes]
    layers: list[torch.Tensor]
    # Bytes of one layer's block; tokens per block; blocks per layer.
    block_bytes: int
    block_size: int
    num_blocks: int
    descriptor: common_pb2.LayoutDescriptor

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * len(self.layers)

    @property
    def on_gpu(self) -> bool:
        return all(t.device.type == "cuda" for t in self.tensors)


class Transfer(ABC):
    """One worker's way of moving blocks. ``load`` fills a job's blocks (what it does not
    fill is reported through the tally, and vLLM recomputes it); ``save`` hands the step's
    saves over, on the step's thread, waiting only for backpressure; ``stop_reading`` stops
    an agent call still reading blocks vLLM wants back. Every save reads its blocks under
    ``reads``' rule."""

    def __init__(
        self,
        kv: KvBlocks,
        agent: AgentClient,
        settings: Settings,
        tally: Tally,
        reads: BlockReads,
    ):
        self.kv, self.agent, self.settings = kv, agent, settings
        self.tally, self.reads = tally, reads
        # Serialises registering with the agent (again, after it lost a registration).
        self._registering = threading.RLock()
        # Saves, in order, off the step's thread.
        self._savers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")

    @abstractmethod
    def register(self) -> None:
        """Registers the memory the agent copies with (raises when the agent refuses)."""

    @abstractmethod
    def load(self, job: Job) -> None:
        """Loads ``job``'s pages into its blocks, returning once they landed."""

    @abstractmethod
    def save(self, jobs: list[Job]) -> None:
        """On the step's thread: hands the step's saves to the save thread."""

    def stop_reading(self, call: str) -> bool:
        """Stops agent call ``call``, which reads blocks vLLM wants back; whether it
        stopped (False: the caller waits for the read to end)."""
        return False

    def shutdown(self) -> None:
        self._savers.shutdown(wait=True)

    # ------------------------------------------------------------ shared by all three

    def _call(self, via: Staging | None, fn: Callable[[], T]) -> T:
        """An agent call through ``via`` (None: vLLM's own blocks). When the agent lost the
        registration the call presented (it restarted), this transfer recovers under the
        registration lock (:meth:`_recover`) and the call is tried once more, or fails: a
        miss."""
        sent_with = self._owner(via)
        try:
            return fn()
        except KvtierError as e:
            if not e.pool_lost:
                raise
            with self._registering:
                if not self._recover(via, sent_with):
                    raise
                return fn()

    @abstractmethod
    def _recover(self, via: Staging | None, sent_with: str) -> bool:
        """Under the registration lock, after a call through ``via`` presenting owner token
        ``sent_with`` found its registration lost: registers again as this transfer does;
        whether the call may be tried again."""

    @abstractmethod
    def _owner(self, via: Staging | None) -> str:
        """The owner token calls through ``via`` present."""

    def _failed(self, via: Staging | None, why: KvtierError) -> None:  # noqa: B027 - a hook
        """After a call through ``via`` failed (nothing to do where there is no pool of
        the worker's own to retire)."""

    def _load_args(self) -> dict[str, Any]:
        """The settings every Load presents."""
        s = self.settings
        return {
            "policy": s.load_policy or None,
            "timeout_ms": s.load_timeout_ms,
            "timeout": s.timeout_s + s.load_timeout_ms / 1000,
        }

    @staticmethod
    def _item(job: Job, pages: Sequence[int]) -> SaveItem:
        return SaveItem(job.prompt(), job.namespace, job.start, pages, job.selected)

    def _save_batch(
        self, via: Staging | None, items: list[SaveItem], call: str | None = None
    ) -> None:
        """On the save thread: one SaveBatch for a step's jobs (the agent copies the pages
        from ``via``, or from vLLM's blocks when None), counting every answer; a call that
        fails counts every page failed. ``call``: its id, for a cancel."""
        t0 = time.monotonic()
        try:
            # The owner token is read at each try: a retry after registering again presents
            # the new one.
            answers = self._call(
                via,
                lambda: self.agent.save_batch(items, owner=self._owner(via), call_id=call),
            )
        except KvtierError as e:
            # The agent counts what it could not save; an agent that cannot be reached
            # cannot count, so it is said here.
            pages = sum(len(i.device_pages) for i in items)
            logger.warning("kvtier: save of %d pages failed: %s", pages, e)
            self.tally.count(save_failed_pages=pages)
            self._failed(via, e)
            return
        for r in answers:
            self._saved(r)
        self.tally.took("save", t0)

    def _saved(self, r: Saved) -> None:
        saved = r.stored + r.present
        self.tally.count(
            saved_pages=saved, saved_bytes=saved * self.kv.page_bytes, save_failed_pages=r.failed
        )
        if r.failed:
            logger.warning("kvtier: %d pages could not be saved to L2", r.failed)


class DmaTransfer(Transfer):
    """The agent maps vLLM's KV cache and copies blocks itself: nothing is copied on the
    worker's side. Saves run on the save thread once the step's event completes, so a
    request's blocks are read after the step (held and given up by ``reads``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # The owner token of the registration.
        self._owner_token = ""

    def register(self) -> None:
        """Registers vLLM's KV cache itself: its allocations by IPC handle and the pieces of
        a page in them (blocks.py). The agent checks the map and reads a page through its
        copy method against plain copies before it accepts. On CPU (the KV cache in shared
        memory, the fuzzer's stand-in for DMA): its files by descriptor, read and written in
        place."""
        kv = self.kv
        where: dict[str, Any]
        if kv.tensors[0].device.type == "cpu":
            ex = cpu_export(kv.tensors)
            where = {"cpu_allocation_fds": ex.fds}
        else:
            ex = cuda_export(kv.tensors)
            where = {"cuda_ordinal": ex.ordinal, "cuda_ipc_handles": ex.handles}
        info = self.agent.register_pool(
            kv.descriptor,
            kv.num_blocks * kv.block_size,
            allocation_bytes=ex.allocation_bytes,
            pieces=pieces(kv.geometry, ex.bases),
            engine_cache=True,
            **where,
        )
        self._owner_token = info.owner

    def _owner(self, via: Staging | None) -> str:
        return self._owner_token

    def _recover(self, via: Staging | None, sent_with: str) -> bool:
        """Registers vLLM's KV cache again, and the call is retried. Only if no other call
        registered since this one was sent: every load and save thread meets the lost
        registration at once, and each registering again would make the others' retries
        stale in turn."""
        if self._owner_token == sent_with:
            logger.warning("kvtier: the agent lost the KV cache (restarted?); again")
            self.register()
        return True

    def load(self, job: Job) -> None:
        """The agent copies the job's pages from L2 straight into vLLM's blocks, returning
        once they landed; pages it could not load are load errors. A load that failed
        (its deadline passed, the agent stopped answering) returns only once no part of its
        copies can still write into the blocks (:meth:`_settle`): until then they are the
        request's, since vLLM keeps an asynchronous load's blocks until it is reported
        finished (and every load is asynchronous where the agent writes into vLLM's blocks,
        ``Settings.load_mode``)."""
        t0 = time.monotonic()
        args = self._load_args()
        call = uuid.uuid4().hex
        # The owner token the load was last sent with (a retry after registering again sends
        # the new one): its Cancel must present the same.
        sent = [self._owner_token]

        def load() -> Any:
            sent[0] = self._owner_token
            return self.agent.load_pages(
                job.prompt(),
                job.namespace,
                job.start,
                job.blocks,
                owner=sent[0],
                call_id=call,
                **args,
            )

        try:
            loaded = self._call(None, load).pages
        except KvtierError as e:
            logger.warning(
                "kvtier: load of %d pages failed, vLLM recomputes: %s", len(job.blocks), e
            )
            loaded = 0
            self._settle(call, sent[0], job)
        loaded = max(0, min(loaded, len(job.blocks)))
        self.tally.missed(job.blocks[loaded:])
        self.tally.count(loaded_pages=loaded, loaded_bytes=loaded * self.kv.page_bytes)
        self.tally.took("load", t0)

    def _settle(self, call: str, owner: str, job: Job) -> None:
        """After load ``call`` failed: returns once none of its copies can still write into
        ``job``'s blocks. The agent's Cancel answers once the call's copies stopped (a call
        that has not reached the agent yet will copy nothing); an agent that does not answer
        (stopped, or too busy) is asked again, for as long as something listens at its
        address; one that is gone (nothing listens) copies nothing more. Meanwhile the
        blocks stay the request's: an agent stopped in the middle of a copy part would write
        the rest of that part into them when it runs again. An agent that refuses the Cancel
        (another process on the socket, which lost this worker's registration; an older
        agent without Cancel) answered, so it runs: the failed call's fence closed when it
        failed (its deadline, or its client leaving), and what may still move is the one part
        each copy thread was in the middle of, done within ``SETTLE_PART_S``. ``owner``: the
        token the load was sent with."""
        t0 = last_log = time.monotonic()
        held = False
        while True:
            try:
                self.agent.cancel([call], owner=owner, timeout=SETTLE_CALL_S)
                break
            except KvtierError as e:
                if e.turned_down:
                    time.sleep(SETTLE_PART_S)
                    break
                if not self.agent.listening():
                    break
                if not held:
                    held = True
                    self.tally.count(load_settle_waits=1)
                if time.monotonic() - last_log >= SETTLE_LOG_S:
                    last_log = time.monotonic()
                    logger.warning(
                        "kvtier: a failed load of %s still waits, %.0f s on, for the agent to "
                        "stop copying into its %d blocks (they stay the request's): %s",
                        job.req_id,
                        last_log - t0,
                        len(job.blocks),
                        e,
                    )
                time.sleep(SETTLE_PAUSE_S)
        if held:
            waited = time.monotonic() - t0
            logger.warning("kvtier: the failed load of %s settled after %.1f s", job.req_id, waited)

    def save(self, jobs: list[Job]) -> None:
        """The agent copies the blocks itself, after an event on the step's stream (on CPU,
        once the step is done). Bounded: a slow L2 slows the steps down rather than let the
        queue grow."""
        ready = None
        if self.kv.tensors[0].device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        pages = sum(len(j.blocks) for j in jobs)
        batch = self.reads.admit(
            jobs,
            pages,
            lambda r: r.pending < DMA_QUEUE,
            0,
            f"{DMA_QUEUE} steps' saves still queued",
        )
        if batch is not None:
            self._savers.submit(self._save_all, jobs, ready, batch)

    def _save_all(self, jobs: list[Job], ready: torch.cuda.Event | None, batch: int) -> None:
        """On the save thread: once the step's work is done, the agent copies every job's
        blocks into L2, in one SaveBatch; never those of a request whose preemption gave up
        waiting (its blocks may be another request's by now), and a preemption that gives up
        while the agent copies cancels the call."""
        try:
            if ready is not None:
                ready.synchronize()
            call = uuid.uuid4().hex
            keep, _ = self.reads.start_reading([(j, None) for j in jobs], batch, call)
            try:
                if keep:
                    self._save_batch(None, [self._item(job, job.blocks) for job, _ in keep], call)
            finally:
                self.reads.end_reading()
        finally:
            self.reads.read(jobs)
            self.reads.done()

    def stop_reading(self, call: str) -> bool:
        """Cancels the SaveBatch ``call``; the agent answers once its copies stopped."""
        try:
            self.agent.cancel([call], owner=self._owner_token)
            return True
        except KvtierError as e:
            logger.warning("kvtier: could not cancel a save still reading: %s", e)
            return False
