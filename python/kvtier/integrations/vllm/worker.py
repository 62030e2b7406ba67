"""The worker side of the vLLM connector: vLLM's KV cache registered with the worker's
kvtier-agent in engine-cache mode, loads into vLLM's blocks before the forward pass (a page
not loaded is reported to vLLM, which recomputes it), and saves of the blocks that became
full after it, under the agent's write policy.

Two transfers (``Settings.transfer``): **dma**, where the agent maps the GPU allocation the
worker exports by CUDA IPC handle and copies blocks itself (saves run on the save thread once
the step's event completes; finished requests' blocks are held until then, and preemptions
wait for them), and **staging**, where the worker copies blocks through a shared-memory pool
the agent maps (on CPU, and wherever the agent's import fails its check)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvtier.agent import AgentClient, Loaded, Saved, SaveItem
from kvtier.host import KvtierError
from kvtier.integrations.vllm.blocks import (
    BlockBytes,
    block_bytes,
    cpu_export,
    cuda_export,
    in_shared_memory,
    pieces,
    storage_bytes,
)
from kvtier.integrations.vllm.common import (
    Counts,
    Job,
    KvtierMetadata,
    Ranks,
    Settings,
    choose_transfer,
)
from kvtier.integrations.vllm.identity import cache_identity
from kvtier.integrations.vllm.staging import Staging
from kvtier.integrations.vllm.stats import COUNTERS, KvtierStats
from kvtier.layout import LayoutSpec, State
from kvtier.v1 import common_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvtier.vllm")

T = TypeVar("T")
U = TypeVar("U")

# After a staging pool could not be replaced, how long until the next try (each try may
# allocate the whole pool in the staging directory again).
STAGING_RETRY_S = 1.0

# DMA: steps whose saves may wait for the save thread at once.
DMA_QUEUE = 8


class WorkerSide:
    """The connector in one vLLM worker process."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: Settings,
        ranks: Ranks,
        agent: AgentClient,
        counts: Counts,
    ):
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.settings, self.ranks, self.agent, self.counts = settings, ranks, agent, counts
        self.block_size = vllm_config.cache_config.block_size
        # MLA's latent is the same on every TP rank: stored once (rank 0 of each PP stage
        # saves), loaded by every rank. (Context parallelism is refused: check_parallel.)
        self.mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.saves = not self.mla or ranks.tp == 0
        # Names this instance where its pages are its own (scales computed at run time).
        self._instance = os.urandom(8).hex()
        self._staging: Staging | None = None
        # When a failed staging replacement is next tried (None: none pending).
        self._replace_after: float | None = None
        self._tensors: list[torch.Tensor] = []
        self._geometry: list[BlockBytes] = []
        self._layers: list[torch.Tensor] = []
        self._layer_names: list[str] = []
        self._block_bytes = 0
        self._descriptor = common_pb2.LayoutDescriptor()
        self._load_errors: set[int] = set()
        # This interval's transfer figures for vLLM's stats (get_kv_connector_stats).
        self._stats = KvtierStats()
        # Requests whose async loads ended since vLLM last asked (get_finished).
        self._recved: set[str] = set()
        self._pending_saves = 0
        self._lock = threading.Lock()
        # DMA: the agent reads vLLM's blocks itself, after the step; the owner token of that
        # registration.
        self._dma = False
        self._owner = ""
        # Staging with the KV cache in host memory, where the scheduler holds blocks until
        # saved: the save thread gathers the blocks, after the step (wait_for_save).
        self._gathers_behind = False
        # Whether finished requests with saves keep their blocks until the saves are done;
        # the scheduler side decides the same from the same settings (Settings.holds_blocks).
        device = str(getattr(vllm_config.device_config, "device_type", "") or "")
        self._holds = settings.holds_blocks(device)
        # Requests that had saves; DMA save jobs not yet done, by request; finished requests
        # held for their saves, not yet reported.
        self._had_saves: set[str] = set()
        self._saving: dict[str, int] = {}
        self._held: set[str] = set()
        # CPU staging saves: pages queued and not yet gathered; the number of the next
        # step's batch of saves; requests whose preemption gave up waiting for their saves,
        # with the last batch given up (gathers of it and earlier skip them; later batches
        # are the resumed request's own); those being gathered now.
        self._queued = 0
        self._batches = 0
        self._abandoned: dict[str, int] = {}
        self._gathering: set[str] = set()
        # DMA: the id of the SaveBatch reading ``_gathering``'s blocks now (a preemption that
        # gives up on it cancels it).
        self._reading_call: str | None = None
        self._saves_done = threading.Condition(self._lock)
        # Serialises replacing the staging pool and registering it.
        self._registering = threading.RLock()
        # Async loads (several requests' L3 fetches at once) and saves (in order), off the
        # step's thread.
        self._loaders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtier-load")
        self._savers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        if not kv_caches:
            raise ValueError("kvtier: vLLM registered no KV cache tensors")
        geometry = [block_bytes(name, t, num_blocks) for name, t in kv_caches.items()]
        per_block = {g.block_bytes for g in geometry}
        forms = {g.form for g in geometry}
        if len(per_block) != 1 or len(forms) != 1:
            raise ValueError(
                f"kvtier: KV layers of different sizes per block {sorted(per_block)} or "
                f"layouts {sorted(forms)}; the connector supports models whose layers are alike"
            )
        size = per_block.pop()
        if size % self.block_size:
            raise ValueError(
                f"kvtier: {size} bytes per block is not a whole number per token "
                f"(block size {self.block_size})"
            )
        tensors = list(kv_caches.values())
        self._tensors = tensors
        self._geometry = geometry
        # Each layer's blocks in kvtier's byte order (blocks.py), over vLLM's memory.
        self._layers = [g.view(storage_bytes(t)) for g, t in zip(geometry, tensors, strict=True)]
        self._layer_names = list(kv_caches)
        self._block_bytes = size
        self._descriptor = self._layout(tensors[0], geometry[0])
        self._choose_transfer()

    def _choose_transfer(self) -> None:
        """DMA where the KV cache is on a GPU and the agent opens it, else the staging pool
        (a fallback from an ``auto`` that could not use DMA is logged and counted)."""
        device = str(self._tensors[0].device)
        on_gpu = all(t.device.type == "cuda" for t in self._tensors)
        self._dma, why = choose_transfer(
            self.settings.transfer,
            device,
            on_gpu,
            self._register_dma,
            in_shared_memory(self._tensors),
        )
        if self._dma:
            logger.info("kvtier: the agent copies vLLM's blocks itself (DMA)")
            return
        if why is not None:
            self._count(dma_fallbacks=1)
            logger.warning("kvtier: %s; the worker copies through a staging pool", why)
        self._gathers_behind = self._holds and not on_gpu
        self._staging = self._new_staging()
        self._register()

    def _register_dma(self) -> None:
        """Registers vLLM's KV cache itself: its allocations by IPC handle and the pieces of
        a page in them (blocks.py). The agent checks the map and reads a page through its
        copy method against plain copies before it accepts. On CPU (the KV cache in shared
        memory, the fuzzer's stand-in for DMA): its files by descriptor, read and written in
        place."""
        where: dict[str, Any]
        if self._tensors[0].device.type == "cpu":
            ex = cpu_export(self._tensors)
            where = {"cpu_allocation_fds": ex.fds}
        else:
            ex = cuda_export(self._tensors)
            where = {"cuda_ordinal": ex.ordinal, "cuda_ipc_handles": ex.handles}
        info = self.agent.register_pool(
            self._descriptor,
            self.kv_cache_config.num_blocks * self.block_size,
            allocation_bytes=ex.allocation_bytes,
            pieces=pieces(self._geometry, ex.bases),
            engine_cache=True,
            **where,
        )
        self._owner = info.owner

    def _new_staging(self) -> Staging:
        st = Staging(len(self._layers), self.settings.staging_pages, self._block_bytes)
        if any(t.device.type == "cuda" for t in self._tensors) and not st.pin():
            logger.warning(
                "kvtier: CUDA refused to page-lock the staging pool (memlock limit?); device "
                "copies through it are synchronous"
            )
        return st

    def _layout(self, sample: torch.Tensor, geometry: BlockBytes) -> common_pb2.LayoutDescriptor:
        """The layout this worker registers: its cache identity's descriptor fields, one
        page per vLLM block (the block's bytes as kvtier stores them), its layers and TP."""
        ident = cache_identity(
            self.vllm_config, self.settings, self._instance, self._layer_names, sample, geometry
        )
        model_id, version = ident.descriptor_fields()
        return LayoutSpec(
            model_id=model_id,
            model_version=version,
            dtype="uint8",
            num_layers=len(self._layers),
            page_size=self.block_size,
            shape=State(geometry.block_bytes // self.block_size),
            tp_rank=0 if self.mla else self.ranks.tp,
            tp_size=1 if self.mla else self.vllm_config.parallel_config.tensor_parallel_size,
        ).descriptor()

    def _register(self) -> None:
        assert self._staging is not None
        info = self.agent.register_pool(
            self._descriptor,
            self._staging.pages * self.block_size,
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

    def _call(self, staging: Staging | None, fn: Callable[[], T]) -> T:
        """An agent call through ``staging`` (None: vLLM's blocks, DMA). After an agent
        restart (the pool unknown to it): DMA registers vLLM's KV cache again and retries
        once; staging registers a new pool (a fresh memfd; the old one is retired) and the
        call fails, a miss, unless the pool was replaced meanwhile."""
        owner = self._owner
        try:
            return fn()
        except KvtierError as e:
            if not e.pool_lost:
                raise
            with self._registering:
                if staging is None:
                    # Only if no other call registered since this one was sent: every load
                    # and save thread meets the lost pool at once, and each registering
                    # again would make the others' retries stale in turn.
                    if self._owner == owner:
                        logger.warning("kvtier: the agent lost the KV cache (restarted?); again")
                        self._register_dma()
                    return fn()
                if staging is not self._staging or staging.retired:
                    raise
                # A new pool (a fresh memfd), and this call, planned against the old one, is a
                # miss.
                logger.warning(
                    "kvtier: the agent lost the pool (restarted?); registering a new one"
                )
                self._replace_staging(staging)
                raise

    def _retire_staging(self, staging: Staging, why: KvtierError) -> None:
        """After a call that may have left the agent copying in ``staging`` (a timeout, a
        dropped connection), that pool is never written again: a new one is registered, and
        the old one closes here once every page taken from it is back (the agent keeps its
        own mapping until its copy ends)."""
        if why.refused:
            return
        with self._registering:
            if staging is not self._staging or staging.retired:
                return
            self._count(retired_staging=1)
            self._replace_staging(staging)

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

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                setattr(self.counts, k, getattr(self.counts, k) + v)
            self._stats.count(**{k: v for k, v in add.items() if k in COUNTERS})

    def _took(self, op: str, since: float) -> None:
        with self._lock:
            self._stats.took(op, time.monotonic() - since)

    def _page_bytes(self) -> int:
        return self._block_bytes * len(self._layers)

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """This interval's loads and saves (then a new interval starts)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KvtierStats()
        return out

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        if self._dma:
            for job in meta.loads:
                if job.load_async:
                    self._loaders.submit(self._load_async, job)
                else:
                    self._load_dma(job)
            return
        if self._staging is None:
            return
        for job in meta.loads:
            if job.load_async:
                self._loaders.submit(self._load_async, job)
            else:
                self._load_job(job, wait=self.settings.timeout_s)

    def _load_async(self, job: Job) -> None:
        """On an I/O thread: the job's pages (L3 fetches included), then the request is
        reported finished receiving; pages that did not load are reported as load errors
        no later than that."""
        try:
            if self._dma:
                self._load_dma(job)
            else:
                self._load_job(job, wait=self.settings.timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed load is a miss, never a lost request
            logger.warning("kvtier: async load of %s failed: %s", job.req_id, e)
            self._missed(job.blocks)
        with self._lock:
            self._recved.add(job.req_id)

    def _missed(self, blocks: Sequence[int]) -> None:
        """Blocks a load did not fill: reported to vLLM, which recomputes from the first."""
        with self._lock:
            self._load_errors.update(blocks)
        self._count(load_error_pages=len(blocks))

    def _load_job(self, job: Job, wait: float) -> None:
        """Loads the job in pieces of the staging pages free (at most half the pool each);
        from the first piece that falls short, the rest are load errors."""
        most = max(1, self.settings.staging_pages // 2)
        rest: Job | None = job
        while rest is not None:
            staging = self._current_staging()
            assert staging is not None
            slots = staging.take(min(most, len(rest.blocks)), wait)
            if not slots:
                logger.warning(
                    "kvtier: no staging page free for a load of %d; vLLM recomputes",
                    len(rest.blocks),
                )
                self._missed(rest.blocks)
                return
            n = len(slots)
            part = rest.head(n, self.block_size)
            loaded = self._load(staging, part, slots)
            if n >= len(rest.blocks):
                return
            if loaded.pages < n:
                self._missed(rest.blocks[n:])
                return
            # The rest follows the last page loaded, whose key the agent named.
            rest = rest.after(n, self.block_size, loaded.last_key)

    def _load_dma(self, job: Job) -> None:
        """The agent copies the job's pages from L2 straight into vLLM's blocks, returning
        once they landed; pages it could not load are load errors."""
        t0 = time.monotonic()
        s = self.settings
        try:
            loaded = self._call(
                None,
                lambda: self.agent.load_pages(
                    job.prompt(),
                    job.namespace,
                    job.start,
                    job.blocks,
                    policy=s.load_policy or None,
                    timeout_ms=s.load_timeout_ms,
                    timeout=s.timeout_s + s.load_timeout_ms / 1000,
                    owner=self._owner,
                ),
            ).pages
        except KvtierError as e:
            logger.warning(
                "kvtier: load of %d pages failed, vLLM recomputes: %s", len(job.blocks), e
            )
            loaded = 0
        loaded = max(0, min(loaded, len(job.blocks)))
        self._missed(job.blocks[loaded:])
        self._count(loaded_pages=loaded, loaded_bytes=loaded * self._page_bytes())
        self._took("load", t0)

    def _load(self, staging: Staging, job: Job, slots: list[int]) -> Loaded:
        """One piece through ``slots``: Load into the staging pages, then into vLLM's
        blocks. Returns how many leading pages loaded (the rest are load errors) and the
        last page's key."""
        t0 = time.monotonic()
        n = len(job.blocks)
        s = self.settings
        last_key = b""
        try:
            got = self._call(
                staging,
                lambda: self.agent.load_pages(
                    job.prompt(),
                    job.namespace,
                    job.start,
                    slots,
                    policy=s.load_policy or None,
                    timeout_ms=s.load_timeout_ms,
                    timeout=s.timeout_s + s.load_timeout_ms / 1000,
                    owner=staging.owner,
                ),
            )
            loaded, last_key = got.pages, got.last_key
        except KvtierError as e:
            logger.warning("kvtier: load of %d pages failed, vLLM recomputes: %s", n, e)
            self._retire_staging(staging, e)
            loaded = 0
        loaded = max(0, min(loaded, n))
        if loaded:
            try:
                staging.to_blocks(self._layers, slots[:loaded], job.blocks[:loaded])
            except Exception as e:  # noqa: BLE001 - a failed copy is a miss, never a dead worker
                logger.warning("kvtier: copying %d loaded pages failed: %s", loaded, e)
                loaded = 0
        staging.give(slots)
        self._missed(job.blocks[loaded:])
        self._count(loaded_pages=loaded, loaded_bytes=loaded * self._page_bytes())
        self._took("load", t0)
        return Loaded(loaded, last_key)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(Finished requests whose blocks were held for their saves and may go now, requests
        whose async loads ended). A request is held by every worker, so every worker reports
        it, once its own saves of it are done (at once on the staging path, whose saves
        copied out of the blocks within the step)."""
        with self._lock:
            done, self._recved = self._recved, set()
            sending: set[str] = set()
            if self._holds:
                self._held |= finished_req_ids & self._had_saves
                self._had_saves -= finished_req_ids
                sending = {r for r in self._held if not self._saving.get(r)}
                self._held -= sending
        return (sending or None), (done or None)

    def handle_preemptions(self, preempted: Sequence[str]) -> None:
        """Before a step reuses preempted requests' blocks: waits for the saves still to read
        them (DMA: the agent's copies; CPU staging: the save thread's gathers), up to the
        agent calls' deadline. Past it the step goes on: the save thread skips the saves of
        those requests it has not begun (a gather, or the agent's DMA copies; counted,
        ``save_preempted_pages``), and one it is in the middle of ends first: a memcpy runs
        out; a SaveBatch in which the agent reads the blocks (DMA) is cancelled, and the
        agent answers once its copies stopped (where the cancel fails, the call's deadline
        ends it)."""
        deadline = time.monotonic() + self.settings.timeout_s + 1.0
        with self._lock:
            while any(self._saving.get(r) for r in preempted):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("kvtier: saves of preempted requests still running")
                    late = {r for r in preempted if self._saving.get(r)}
                    for r in late:
                        self._abandoned[r] = self._batches - 1
                    if not self._gathering & late:
                        return
                    call = self._reading_call
                    break
                self._saves_done.wait(left)
            else:
                return
        # The save thread is reading their blocks now. DMA: the agent's SaveBatch reads
        # them; cancel it (the answer comes once its copies stopped). Else, or when the
        # cancel fails, wait for the read to end (a gather's memcpy; the call's deadline).
        if call is not None and self._cancel(call):
            return
        with self._lock:
            while self._gathering & late:
                self._saves_done.wait()

    def _cancel(self, call: str) -> bool:
        """Cancels the agent call ``call``; whether the agent stopped its copies."""
        try:
            self.agent.cancel([call], owner=self._owner)
            return True
        except KvtierError as e:
            logger.warning("kvtier: could not cancel a save still reading: %s", e)
            return False

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        """Hands the step's new blocks to the save thread; the step waits for neither the
        copy nor the agent. DMA: the agent copies the blocks itself after an event on the
        stream. Staging on CPU: the save thread gathers the blocks into staging pages after
        the step (the blocks are held until then: ``request_finished`` keeps a finished
        request's, ``handle_preemptions`` waits for a preempted one's); the step waits only
        when the saves before it have more pages still to gather than the staging pool
        holds. Staging on a GPU: the step enqueues the gather on its stream (no host sync)
        and the save thread waits for its event. Pages that find no staging page within
        ``timeout_s`` are dropped, counted (``save_dropped_pages``)."""
        if self._holds:
            # Only where the scheduler holds finished requests' blocks: get_finished reports
            # (and forgets) exactly these.
            with self._lock:
                self._had_saves.update(j.req_id for j in meta.saves)
        if not self.saves or not meta.saves:
            return
        if self._dma:
            # The step's KV writes are done once this event is (on CPU, when the step is).
            ready = None
            if self._tensors[0].device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            pages = sum(len(j.blocks) for j in meta.saves)
            # Bounded: a slow L2 slows the steps down rather than let the queue grow.
            batch = self._admit(
                meta.saves,
                pages,
                lambda: self._pending_saves < DMA_QUEUE,
                0,
                f"{DMA_QUEUE} steps' saves still queued",
            )
            if batch is None:
                return
            self._savers.submit(self._save_dma_all, meta.saves, ready, batch)
            return
        staging = self._current_staging()
        if staging is None:
            return
        if self._gathers_behind:
            self._queue_behind(staging, meta.saves)
            return
        self._plan(staging, meta.saves, lambda planned, _: self._hand_over(staging, planned))

    def _plan(
        self,
        staging: Staging,
        jobs: list[Job],
        run: Callable[[list[tuple[Job, list[int]]], bool], None],
    ) -> None:
        """Splits ``jobs`` over free staging pages and runs each batch (``run(planned,
        last)``); when no page is free, runs what is planned (its pages come back as it is
        saved) and waits for pages, up to ``timeout_s``."""
        planned: list[tuple[Job, list[int]]] = []
        for job in jobs:
            rest: Job | None = job
            while rest is not None:
                slots = staging.take(len(rest.blocks))
                if not slots:
                    run(planned, False)
                    planned = []
                    slots = staging.take(len(rest.blocks), wait=self.settings.timeout_s)
                if not slots:
                    self._count(save_dropped_pages=len(rest.blocks))
                    logger.warning(
                        "kvtier: %d pages not saved: no staging page came free in %.1f s",
                        len(rest.blocks),
                        self.settings.timeout_s,
                    )
                    break
                part, rest = rest.split(len(slots), self.block_size)
                planned.append((part, slots))
        run(planned, True)

    def _reading(self, jobs: list[Job]) -> None:
        """Under the lock: saves handed to the save thread that will read these requests'
        blocks."""
        for j in jobs:
            self._saving[j.req_id] = self._saving.get(j.req_id, 0) + 1

    def _read(self, jobs: list[Job]) -> None:
        """Under the lock: these saves read their blocks, which may be reused now."""
        for job in jobs:
            left = self._saving.get(job.req_id, 1) - 1
            if left:
                self._saving[job.req_id] = left
            else:
                self._saving.pop(job.req_id, None)
                self._abandoned.pop(job.req_id, None)
        self._saves_done.notify_all()

    def _queue_behind(self, staging: Staging, jobs: list[Job]) -> None:
        """On the step's thread (CPU staging): queues the step's saves for the save thread.
        Waits, up to ``timeout_s``, while the saves queued before hold more pages not yet
        gathered than the staging pool has (saves falling behind slow the steps down rather
        than pile up); a step's saves that still find no room are dropped, counted."""
        pages = sum(len(j.blocks) for j in jobs)
        batch = self._admit(
            jobs,
            pages,
            lambda: not self._queued or self._queued + pages <= staging.pages,
            pages,
            "the saves before them did not gather theirs",
        )
        if batch is None:
            return
        self._savers.submit(self._save_behind, jobs, pages, batch)

    def _admit(
        self,
        jobs: list[Job],
        pages: int,
        room: Callable[[], bool],
        queued: int,
        why: str,
    ) -> int | None:
        """On the step's thread: waits up to ``timeout_s`` for ``room()`` (under the lock),
        then numbers the step's batch of saves, marks its jobs as reading their blocks and
        adds ``queued`` pages still to gather. None when no room came: the step's pages
        are dropped, counted (``save_dropped_pages``)."""
        with self._lock:
            if self._saves_done.wait_for(room, timeout=self.settings.timeout_s):
                self._queued += queued
                self._reading(jobs)
                self._pending_saves += 1
                batch = self._batches
                self._batches += 1
                return batch
        self._count(save_dropped_pages=pages)
        logger.warning(
            "kvtier: %d pages not saved: %s after %.1f s", pages, why, self.settings.timeout_s
        )
        return None

    def _save_behind(self, jobs: list[Job], pages: int, batch: int) -> None:
        """On the save thread (CPU staging): gathers a step's blocks into staging pages of
        the current pool and saves them in one SaveBatch (more where the pool runs short);
        the blocks are released after the last gather, before the last call."""
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                self._queued -= pages
                self._read(jobs)
            released = True

        def run(staging: Staging, planned: list[tuple[Job, list[int]]], last: bool) -> None:
            planned = self._gather_behind(staging, planned, batch) if planned else []
            if last:
                release()
            if planned:
                self._save_staged(staging, planned, None)

        try:
            staging = self._staging
            if staging is None:
                # No pool since a retirement could not register a new one.
                self._count(save_dropped_pages=pages)
            else:
                self._plan(staging, jobs, lambda planned, last: run(staging, planned, last))
        finally:
            if not released:
                release()
            with self._lock:
                self._pending_saves -= 1

    def _gather_behind(
        self, staging: Staging, planned: list[tuple[Job, list[int]]], batch: int
    ) -> list[tuple[Job, list[int]]]:
        """Gathers the planned blocks, leaving out those of requests whose preemption gave
        up waiting for them (their blocks may hold another request's KV by now; counted,
        ``save_preempted_pages``). What is left to save, empty when the copy raised."""
        keep, gone = self._start_reading(planned, batch)
        try:
            for _, sl in gone:
                staging.give(sl)
            if not keep or not self._gather(staging, keep)[0]:
                return []
            return keep
        finally:
            self._end_reading()

    def _start_reading(
        self, items: list[tuple[Job, U]], batch: int, call: str | None = None
    ) -> tuple[list[tuple[Job, U]], list[tuple[Job, U]]]:
        """Before the save thread reads batch ``batch``'s blocks (a gather, or the agent's
        DMA copies): the items to read, and those given up because their request's
        preemption stopped waiting for them (their blocks may hold another request's KV by
        now; counted, ``save_preempted_pages``). Decided under one lock with the reading
        marked: a preemption that gives up after this finds them in ``_gathering`` and
        waits until ``_end_reading``."""
        with self._lock:
            keep, gone = [], []
            for item in items:
                (gone if self._abandoned.get(item[0].req_id, -1) >= batch else keep).append(item)
            self._gathering = {j.req_id for j, _ in keep}
            self._reading_call = call
        if gone:
            self._count(save_preempted_pages=sum(len(j.blocks) for j, _ in gone))
        return keep, gone

    def _end_reading(self) -> None:
        with self._lock:
            self._gathering = set()
            self._reading_call = None
            self._saves_done.notify_all()

    def _save_dma_all(self, jobs: list[Job], ready: torch.cuda.Event | None, batch: int) -> None:
        """On the save thread: once the step's work is done, the agent copies every job's
        blocks into L2, in one SaveBatch; never those of a request whose preemption gave up
        waiting (its blocks may be another request's by now), and a preemption that gives up
        while the agent copies waits for the call to end."""
        try:
            if ready is not None:
                ready.synchronize()
            call = uuid.uuid4().hex
            keep, _ = self._start_reading([(j, None) for j in jobs], batch, call)
            try:
                if keep:
                    items = [self._item(job, job.blocks) for job, _ in keep]
                    self._save_batch(None, items, call)
            finally:
                self._end_reading()
        finally:
            with self._lock:
                self._read(jobs)
                self._pending_saves -= 1
                self._saves_done.notify_all()

    @staticmethod
    def _item(job: Job, pages: Sequence[int]) -> SaveItem:
        return SaveItem(job.prompt(), job.namespace, job.start, pages, job.selected)

    def _save_batch(
        self, staging: Staging | None, items: list[SaveItem], call: str | None = None
    ) -> None:
        """On the save thread: one SaveBatch for a step's jobs (the agent copies the pages
        from ``staging``, or from vLLM's blocks when None), counting every answer; a call
        that fails counts every page failed. ``call``: its id, for a cancel."""
        t0 = time.monotonic()
        try:
            # The owner token is read at each try: a retry after registering again presents
            # the new one.
            answers = self._call(
                staging,
                lambda: self.agent.save_batch(
                    items, owner=self._owner if staging is None else staging.owner, call_id=call
                ),
            )
        except KvtierError as e:
            # The agent counts what it could not save; an agent that cannot be reached
            # cannot count, so it is said here.
            pages = sum(len(i.device_pages) for i in items)
            logger.warning("kvtier: save of %d pages failed: %s", pages, e)
            self._count(save_failed_pages=pages)
            if staging is not None:
                self._retire_staging(staging, e)
            return
        for r in answers:
            self._saved(r)
        self._took("save", t0)

    def _saved(self, r: Saved) -> None:
        """Counts a Save's answer, for either transfer."""
        saved = r.stored + r.present
        self._count(
            saved_pages=saved, saved_bytes=saved * self._page_bytes(), save_failed_pages=r.failed
        )
        if r.failed:
            logger.warning("kvtier: %d pages could not be saved to L2", r.failed)

    def _gather(
        self, staging: Staging, planned: list[tuple[Job, list[int]]]
    ) -> tuple[bool, torch.cuda.Event | None]:
        """Copies the planned blocks into their staging pages (one gather per layer): (False,
        None) when the copy raised (its pages given back and counted failed), else (True,
        the copies' event on a GPU or None)."""
        blocks = [b for part, _ in planned for b in part.blocks]
        slots = [x for _, sl in planned for x in sl]
        try:
            return True, staging.from_blocks(self._layers, blocks, slots)
        except Exception as e:  # noqa: BLE001 - a failed copy is a skipped save, never a dead worker
            logger.warning("kvtier: copying %d pages to staging failed: %s", len(slots), e)
            self._count(save_failed_pages=len(slots))
            staging.give(slots)
            return False, None

    def _hand_over(self, staging: Staging, planned: list[tuple[Job, list[int]]]) -> None:
        """On the step's thread (GPU staging): enqueues the planned blocks' copies into their
        staging pages and queues their Saves on the save thread."""
        if not planned:
            return
        copied, ready = self._gather(staging, planned)
        if not copied:
            return
        with self._lock:
            self._pending_saves += 1
        self._savers.submit(self._save_all, staging, planned, ready)

    def _save_all(
        self,
        staging: Staging,
        planned: list[tuple[Job, list[int]]],
        ready: torch.cuda.Event | None,
    ) -> None:
        try:
            self._save_staged(staging, planned, ready)
        finally:
            with self._lock:
                self._pending_saves -= 1

    def _save_staged(
        self,
        staging: Staging,
        planned: list[tuple[Job, list[int]]],
        ready: torch.cuda.Event | None,
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

    def drain(self, timeout: float = 30.0) -> bool:
        """Waits for the saves handed to the save thread; True when none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_saves == 0:
                    return True
            time.sleep(0.002)
        return False

    def shutdown(self) -> None:
        self.drain(self.settings.timeout_s)
        self._loaders.shutdown(wait=True, cancel_futures=True)
        self._savers.shutdown(wait=True)
        if self._staging is not None:
            self._staging.retire()
