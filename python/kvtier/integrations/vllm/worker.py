"""The worker side of the vLLM connector: vLLM's KV cache registered with the worker's
kvtier-agent in engine-cache mode, loads into vLLM's blocks before the forward pass (a page
not loaded is reported to vLLM, which recomputes it), and saves of the blocks that became
full after it, under the agent's write policy.

:class:`WorkerSide` keeps vLLM's bookkeeping (asynchronous loads, finished requests held
for their saves, load errors, stats); how blocks move is its :class:`Transfer`, chosen once
when vLLM registers its KV cache (``Settings.transfer``): **dma** (transfer.py), where the
agent maps the GPU allocation the worker exports by CUDA IPC handle and copies blocks
itself, or a **staging** pool the worker copies through and the agent maps (staged.py: on
CPU, and wherever the agent's import fails its check). When a save may still read a
request's blocks is one rule for all three (reads.py)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from kvtier.agent import AgentClient
from kvtier.integrations.vllm.blocks import (
    BlockBytes,
    block_bytes,
    in_shared_memory,
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
from kvtier.integrations.vllm.reads import BlockReads
from kvtier.integrations.vllm.staged import CpuStaging, GpuStaging
from kvtier.integrations.vllm.stats import KvtierStats, Tally
from kvtier.integrations.vllm.transfer import DmaTransfer, KvBlocks, Transfer
from kvtier.layout import LayoutSpec, State
from kvtier.v1 import common_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvtier.vllm")


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
        self.tally = Tally(counts)
        self.reads = BlockReads(settings.timeout_s, self.tally)
        # Chosen once vLLM registers its KV cache.
        self.transfer: Transfer | None = None
        self._lock = threading.Lock()
        # Requests whose async loads ended since vLLM last asked (get_finished).
        self._recved: set[str] = set()
        # Whether finished requests with saves keep their blocks until the saves are done;
        # the scheduler side decides the same from the same settings (Settings.holds_blocks).
        device = str(getattr(vllm_config.device_config, "device_type", "") or "")
        self._holds = settings.holds_blocks(device)
        # Requests that had saves; finished requests held for their saves, not yet reported.
        self._had_saves: set[str] = set()
        self._held: set[str] = set()
        # Async loads: several requests' L3 fetches at once, off the step's thread.
        self._loaders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtier-load")

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
        kv = KvBlocks(
            tensors=tensors,
            geometry=geometry,
            # Each layer's blocks in kvtier's byte order (blocks.py), over vLLM's memory.
            layers=[g.view(storage_bytes(t)) for g, t in zip(geometry, tensors, strict=True)],
            block_bytes=size,
            block_size=self.block_size,
            num_blocks=num_blocks,
            descriptor=self._layout(list(kv_caches), tensors[0], geometry[0]),
        )
        self.transfer = self._choose_transfer(kv)

    def _choose_transfer(self, kv: KvBlocks) -> Transfer:
        """DMA where the KV cache is on a GPU and the agent opens it, else the staging pool
        (a fallback from an ``auto`` that could not use DMA is logged and counted): on CPU
        gathered after the step, on a GPU within it."""
        parts = (kv, self.agent, self.settings, self.tally, self.reads)
        dma = DmaTransfer(*parts)
        use_dma, why = choose_transfer(
            self.settings.transfer,
            str(kv.tensors[0].device),
            kv.on_gpu,
            dma.register,
            in_shared_memory(kv.tensors),
        )
        if use_dma:
            logger.info("kvtier: the agent copies vLLM's blocks itself (DMA)")
            return dma
        dma.shutdown()
        if why is not None:
            self.tally.count(dma_fallbacks=1)
            logger.warning("kvtier: %s; the worker copies through a staging pool", why)
        # Gathered after the step only where the scheduler holds the blocks for it (on CPU
        # it always does); else within the step, as a GPU's stream does.
        behind = self._holds and not kv.on_gpu
        staged = CpuStaging(*parts) if behind else GpuStaging(*parts)
        staged.register()
        return staged

    def _layout(
        self, names: list[str], sample: torch.Tensor, geometry: BlockBytes
    ) -> common_pb2.LayoutDescriptor:
        """The layout this worker registers: its cache identity's descriptor fields, one
        page per vLLM block (the block's bytes as kvtier stores them), its layers and TP."""
        ident = cache_identity(
            self.vllm_config, self.settings, self._instance, names, sample, geometry
        )
        model_id, version = ident.descriptor_fields()
        return LayoutSpec(
            model_id=model_id,
            model_version=version,
            dtype="uint8",
            num_layers=len(names),
            page_size=self.block_size,
            shape=State(geometry.block_bytes // self.block_size),
            tp_rank=0 if self.mla else self.ranks.tp,
            tp_size=1 if self.mla else self.vllm_config.parallel_config.tensor_parallel_size,
        ).descriptor()

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """This interval's loads and saves (then a new interval starts)."""
        return self.tally.take_stats()

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        transfer = self.transfer
        if transfer is None:
            return
        for job in meta.loads:
            if job.load_async:
                self._loaders.submit(self._load_async, transfer, job)
            else:
                transfer.load(job)

    def _load_async(self, transfer: Transfer, job: Job) -> None:
        """On an I/O thread: the job's pages (L3 fetches included), then the request is
        reported finished receiving; pages that did not load are reported as load errors
        no later than that."""
        try:
            transfer.load(job)
        except Exception as e:  # noqa: BLE001 - a failed load is a miss, never a lost request
            logger.warning("kvtier: async load of %s failed: %s", job.req_id, e)
            self.tally.missed(job.blocks)
        with self._lock:
            self._recved.add(job.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(Finished requests whose blocks were held for their saves and may go now, requests
        whose async loads ended). A request is held by every worker, so every worker reports
        it, once its own saves of it are done (at once where saves read the blocks within
        the step: GPU staging)."""
        with self._lock:
            done, self._recved = self._recved, set()
            sending: set[str] = set()
            if self._holds:
                self._held |= finished_req_ids & self._had_saves
                self._had_saves -= finished_req_ids
                sending = self.reads.unread(self._held)
                self._held -= sending
        return (sending or None), (done or None)

    def handle_preemptions(self, preempted: Sequence[str]) -> None:
        """Before a step reuses preempted requests' blocks: waits for the saves still to read
        them, up to the agent calls' deadline, then gives them up (reads.py: those not begun
        skip the requests, counted ``save_preempted_pages``; a DMA SaveBatch reading them is
        cancelled, and a memcpy runs out)."""
        transfer = self.transfer
        if transfer is not None:
            self.reads.give_up(preempted, transfer.stop_reading)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.tally.take_load_errors()

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        """Hands the step's new blocks to the transfer; the step waits for neither the copy
        nor the agent, only for backpressure (saves falling behind). Pages that find no room
        within ``timeout_s`` are dropped, counted (``save_dropped_pages``)."""
        if self._holds:
            # Only where the scheduler holds finished requests' blocks: get_finished reports
            # (and forgets) exactly these.
            with self._lock:
                self._had_saves.update(j.req_id for j in meta.saves)
        if not self.saves or not meta.saves or self.transfer is None:
            return
        self.transfer.save(meta.saves)

    def drain(self, timeout: float = 30.0) -> bool:
        """Waits for the saves handed to the save thread; True when none is left."""
        return self.reads.drain(timeout)

    def shutdown(self) -> None:
        self.drain(self.settings.timeout_s)
        self._loaders.shutdown(wait=True, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.shutdown()
