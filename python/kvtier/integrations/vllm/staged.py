"""The staging transfers: the worker copies blocks through a shared-memory pool the agent
maps (staging.py), where the agent cannot map vLLM's KV cache itself (on CPU, and where a
GPU's export fails the agent's check).

- :class:`CpuStaging`: the save thread gathers a step's blocks into staging pages after the
  step; its blocks are held and given up under ``reads``' rule, as DMA's are.
- :class:`GpuStaging`: the step's stream gathers the blocks within the step (asynchronous
  copies into the page-locked pool); the save thread waits for their event. Nothing reads a
  block after the step.

Both load in pieces of at most half the pool, and retire a pool the agent may still be
copying in (a call that timed out or dropped) for a new one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.agent import Loaded
from kvtier.host import KvtierError
from kvtier.integrations.vllm.staging import Staging
from kvtier.integrations.vllm.transfer import Transfer

if TYPE_CHECKING:
    from kvtier.integrations.vllm.common import Job

logger = logging.getLogger("kvtier.vllm")

# After a staging pool could not be replaced, how long until the next try (each try may
# allocate the whole pool in the staging directory again).
STAGING_RETRY_S = 1.0

# Pages of a step's saves, each with the staging pages it is copied through.
Planned = list[tuple["Job", list[int]]]


class StagedTransfer(Transfer):
    """The staging pool's life (registered, retired, replaced) and what both staging
    transfers do alike: loads in pieces, the step's saves split over free pages."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._staging: Staging | None = None
        # When a failed staging replacement is next tried (None: none pending).
        self._replace_after: float | None = None

    def register(self) -> None:
        self._staging = self._new_staging()
        self._register()

    def shutdown(self) -> None:
        super().shutdown()
        if self._staging is not None:
            self._staging.retire()

    def _new_staging(self) -> Staging:
        kv = self.kv
        st = Staging(len(kv.layers), self.settings.staging_pages, kv.block_bytes)
        if any(t.device.type == "cuda" for t in kv.tensors) and not st.pin():
            logger.warning(
                "kvtier: CUDA refused to page-lock the staging pool (memlock limit?); device "
                "copies through it are synchronous"
            )
        return st

    def _register(self) -> None:
        assert self._staging is not None
        info = self.agent.register_pool(
            self.kv.descriptor,
            self._staging.pages * self.kv.block_size,
            cpu_fd=self._staging.fd,
            engine_cache=True,
        )
        # Calls through this pool present this token: once another pool is registered, a
        # call planned against this one is refused, never served against the other. An
        # agent that loses the pool (a restart) gets a new one (_call).
        self._staging.owner = info.owner
        if not info.daemon_connected:
            logger.warning(
                "kvtier: the agent at %s has no kvtierd session yet; saves wait for it",
                self.agent.address,
            )

    def _owner(self, via: Staging | None) -> str:
        assert via is not None
        return via.owner

    def _recover(self, via: Staging | None, sent_with: str) -> bool:
        """Registers a new pool (a fresh memfd; the old one is retired), unless the pool
        was replaced meanwhile; the call, planned against the old one, is never retried:
        a miss."""
        if via is self._staging and via is not None and not via.retired:
            logger.warning("kvtier: the agent lost the pool (restarted?); registering a new one")
            self._replace_staging(via)
        return False

    def _failed(self, via: Staging | None, why: KvtierError) -> None:
        """After a call that may have left the agent copying in ``via`` (a timeout, a
        dropped connection), that pool is never written again: a new one is registered, and
        the old one closes here once every page taken from it is back (the agent keeps its
        own mapping until its copy ends)."""
        if why.refused or via is None:
            return
        with self._registering:
            if via is not self._staging or via.retired:
                return
            self.tally.count(retired_staging=1)
            self._replace_staging(via)

    def _replace_staging(self, staging: Staging) -> None:
        """Under ``_registering``: retires ``staging`` and registers a new pool. When that
        fails (the agent still restarting, no room in the staging directory), the next
        transfer tries again (``_current_staging``), at most every ``STAGING_RETRY_S``."""
        # Until the new pool is registered, calls present no owner token: the agent
        # refuses them rather than serve them against the old pool.
        self.agent.forget_registration()
        staging.retire()
        try:
            self._staging = self._new_staging()
            self._register()
            self._replace_after = None
        except (KvtierError, OSError, ValueError) as e:
            logger.warning("kvtier: could not register a new staging pool: %s", e)
            self._replace_after = time.monotonic() + STAGING_RETRY_S

    def _current_staging(self) -> Staging | None:
        """The staging pool transfers go through now; after a replacement that failed, a
        new try when one is due (else transfers meanwhile are misses and dropped saves,
        counted, never a pool the agent may still be copying in)."""
        due = self._replace_after
        if due is not None and time.monotonic() >= due:
            with self._registering:
                staging = self._staging
                if self._replace_after is not None and staging is not None:
                    self._replace_staging(staging)
        return self._staging

    # ------------------------------------------------------------------ loads

    def load(self, job: Job) -> None:
        """Loads the job in pieces of the staging pages free (at most half the pool each);
        from the first piece that falls short, the rest are load errors."""
        most = max(1, self.settings.staging_pages // 2)
        bs = self.kv.block_size
        # A load that goes in pieces (larger than half the pool, or the pool busy with other
        # transfers) names its whole size in each, so kvtierd judges load versus recompute
        # once for the load; 0 while the first piece may be the whole.
        whole = 0
        rest: Job | None = job
        while rest is not None:
            staging = self._current_staging()
            assert staging is not None
            slots = staging.take(min(most, len(rest.blocks)), self.settings.timeout_s)
            if not slots:
                logger.warning(
                    "kvtier: no staging page free for a load of %d; vLLM recomputes",
                    len(rest.blocks),
                )
                self.tally.missed(rest.blocks)
                return
            n = len(slots)
            if n < len(rest.blocks):
                whole = len(job.blocks)
            loaded = self._load_piece(staging, rest.head(n, bs), slots, whole)
            if n >= len(rest.blocks):
                return
            if loaded.pages < n:
                self.tally.missed(rest.blocks[n:])
                return
            # The rest follows the last page loaded, whose key the agent named.
            rest = rest.after(n, bs, loaded.last_key)

    def _load_piece(self, staging: Staging, job: Job, slots: list[int], whole: int) -> Loaded:
        """One piece (of a load of ``whole`` pages; 0: the piece is the load) through
        ``slots``: Load into the staging pages, then into vLLM's blocks. Returns how many
        leading pages loaded (the rest are load errors) and the last page's key."""
        t0 = time.monotonic()
        n = len(job.blocks)
        args = self._load_args()
        args["whole_load_pages"] = whole
        last_key = b""
        try:
            got = self._call(
                staging,
                lambda: self.agent.load_pages(
                    job.prompt(), job.namespace, job.start, slots, owner=staging.owner, **args
                ),
            )
            loaded, last_key = got.pages, got.last_key
        except KvtierError as e:
            logger.warning("kvtier: load of %d pages failed, vLLM recomputes: %s", n, e)
            self._failed(staging, e)
            loaded = 0
        loaded = max(0, min(loaded, n))
        if loaded:
            try:
                staging.to_blocks(self.kv.layers, slots[:loaded], job.blocks[:loaded])
            except Exception as e:  # noqa: BLE001 - a failed copy is a miss, never a dead worker
                logger.warning("kvtier: copying %d loaded pages failed: %s", loaded, e)
                loaded = 0
        staging.give(slots)
        self.tally.missed(job.blocks[loaded:])
        self.tally.count(loaded_pages=loaded, loaded_bytes=loaded * self.kv.page_bytes)
        self.tally.took("load", t0)
        return Loaded(loaded, last_key)

    # ------------------------------------------------------------------ saves

    def _plan(
        self, staging: Staging, jobs: list[Job], run: Callable[[Planned, bool], None]
    ) -> None:
        """Splits ``jobs`` over free staging pages and runs each batch (``run(planned,
        last)``); when no page is free, runs what is planned (its pages come back as it is
        saved) and waits for pages, up to ``timeout_s``."""
        planned: Planned = []
        for job in jobs:
            rest: Job | None = job
            while rest is not None:
                slots = staging.take(len(rest.blocks))
                if not slots:
                    run(planned, False)
                    planned = []
                    slots = staging.take(len(rest.blocks), wait=self.settings.timeout_s)
                if not slots:
                    self.tally.count(save_dropped_pages=len(rest.blocks))
                    logger.warning(
                        "kvtier: %d pages not saved: no staging page came free in %.1f s",
                        len(rest.blocks),
                        self.settings.timeout_s,
                    )
                    break
                part, rest = rest.split(len(slots), self.kv.block_size)
                planned.append((part, slots))
        run(planned, True)

    def _gather(self, staging: Staging, planned: Planned) -> tuple[bool, torch.cuda.Event | None]:
        """Copies the planned blocks into their staging pages (one gather per layer): (False,
        None) when the copy raised (its pages given back and counted failed), else (True,
        the copies' event on a GPU or None)."""
        blocks = [b for part, _ in planned for b in part.blocks]
        slots = [x for _, sl in planned for x in sl]
        try:
            return True, staging.from_blocks(self.kv.layers, blocks, slots)
        except Exception as e:  # noqa: BLE001 - a failed copy is a skipped save, never a dead worker
            logger.warning("kvtier: copying %d pages to staging failed: %s", len(slots), e)
            self.tally.count(save_failed_pages=len(slots))
            staging.give(slots)
            return False, None

    def _save_staged(
        self, staging: Staging, planned: Planned, ready: torch.cuda.Event | None
    ) -> None:
        """On the save thread: a batch's saves in one SaveBatch, once the copies into their
        staging pages have landed (a GPU's asynchronous copies: their event); then the
        staging pages are free again."""
        try:
            if ready is not None:
                ready.synchronize()
            self._save_batch(staging, [self._item(job, slots) for job, slots in planned])
        finally:
            for _, slots in planned:
                staging.give(slots)


class CpuStaging(StagedTransfer):
    """The KV cache in host memory: the step queues its saves, and the save thread gathers
    their blocks after the step (a memcpy vLLM's step need not wait for). The step waits
    only when the saves before it have more pages still to gather than the pool holds."""

    def save(self, jobs: list[Job]) -> None:
        """Waits, up to ``timeout_s``, while the saves queued before hold more pages not yet
        gathered than the staging pool has (saves falling behind slow the steps down rather
        than pile up); a step's saves that still find no room are dropped, counted."""
        staging = self._current_staging()
        if staging is None:
            return
        pages = sum(len(j.blocks) for j in jobs)
        batch = self.reads.admit(
            jobs,
            pages,
            lambda r: not r.queued or r.queued + pages <= staging.pages,
            pages,
            "the saves before them did not gather theirs",
        )
        if batch is not None:
            self._savers.submit(self._save_behind, jobs, pages, batch)

    def _save_behind(self, jobs: list[Job], pages: int, batch: int) -> None:
        """On the save thread: gathers a step's blocks into staging pages of the current
        pool and saves them in one SaveBatch (more where the pool runs short); the blocks
        are released after the last gather, before the last call."""
        released = False

        def release() -> None:
            nonlocal released
            self.reads.read(jobs, queued=pages)
            released = True

        def run(staging: Staging, planned: Planned, last: bool) -> None:
            planned = self._gather_behind(staging, planned, batch) if planned else []
            if last:
                release()
            if planned:
                self._save_staged(staging, planned, None)

        try:
            staging = self._staging
            if staging is None:
                # No pool since a retirement could not register a new one.
                self.tally.count(save_dropped_pages=pages)
            else:
                self._plan(staging, jobs, lambda planned, last: run(staging, planned, last))
        finally:
            if not released:
                release()
            self.reads.done()

    def _gather_behind(self, staging: Staging, planned: Planned, batch: int) -> Planned:
        """Gathers the planned blocks, leaving out those of requests whose preemption gave
        up waiting for them (counted). What is left to save, empty when the copy raised."""
        keep, gone = self.reads.start_reading(planned, batch)
        try:
            for _, sl in gone:
                staging.give(sl)
            if not keep or not self._gather(staging, keep)[0]:
                return []
            return keep
        finally:
            self.reads.end_reading()


class GpuStaging(StagedTransfer):
    """The KV cache on a GPU the agent cannot map: the step's stream gathers the blocks
    into the page-locked pool within the step (no host sync), and the save thread waits for
    the copies' event before the agent reads the pages."""

    def save(self, jobs: list[Job]) -> None:
        staging = self._current_staging()
        if staging is None:
            return
        self._plan(staging, jobs, lambda planned, _: self._hand_over(staging, planned))

    def _hand_over(self, staging: Staging, planned: Planned) -> None:
        """Enqueues the planned blocks' copies into their staging pages and queues their
        Saves on the save thread."""
        if not planned:
            return
        copied, ready = self._gather(staging, planned)
        if not copied:
            return
        self.reads.handed_over()
        self._savers.submit(self._save_all, staging, planned, ready)

    def _save_all(self, staging: Staging, planned: Planned, ready: torch.cuda.Event | None) -> None:
        try:
            self._save_staged(staging, planned, ready)
        finally:
            self.reads.done()
