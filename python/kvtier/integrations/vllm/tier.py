"""kvtier's L2 and L3 as a secondary tier of vLLM's own KV offloading (``OffloadingConnector``
with ``TieringOffloadingSpec``): vLLM keeps its CPU tier, and kvtierd's node-wide, shared,
crash-surviving pool (and the L3 behind it) goes under it::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "kvtier",
                "module_path": "kvtier.integrations.vllm.tier",
                "socket": "/var/lib/kvtier/kvtierd.sock"}]}}'

vLLM's ``SecondaryTierFactory`` imports ``module_path`` and takes the class named by
``type`` from it (``kvtier`` here, an alias of :class:`KvtierTier`); the tier's other keys
are :class:`Settings`. vLLM's tiering manager (``TieringOffloadingManager``) cascades every
chunk stored in its CPU tier to this one (``submit_store``), looks chunks its CPU tier
lacks up here (``lookup``), and promotes hits back into its CPU tier (``submit_load``). A
chunk is one row of vLLM's shared CPU region (every worker's bytes of the chunk); the tier
copies whole rows between that region and kvtierd's mapped pool (Reserve/Commit for stores,
Acquire/Release and a Prefetch from L3 for loads), on its own threads: the scheduler's
thread only queues work, and ``get_finished_jobs`` hands vLLM the results.

Nothing raises into vLLM: kvtierd down, a timeout, a page that left L2 are misses or failed
jobs, counted in :attr:`KvtierTier.counters` (a failed store is also a failed cascade job in
vLLM's metrics and, with a backpressure detector configured, a failure it sees).
docs/vllm.md ("vLLM's own offloading, with kvtier under it") says when to use this rather
than kvtier's connector.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import inspect
import logging
import os
import queue
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.host import POLICIES, DaemonClient
from kvtier.identity import CacheIdentity, WeightEpoch, checkpoint_digest
from kvtier.integrations.vllm.identity import engine_identity, layer_range
from kvtier.keys import Namespace
from kvtier.layout import LayoutSpec, State
from kvtier.pool_link import PoolLink, Reporter
from kvtier.settings import fill
from kvtier.v1 import common_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvtier.vllm")

# Most keys one kvtierd call carries: a lookup or a job of more goes in several calls (kvtierd
# refuses a call past its `server.max_batch`, 65,536 by default).
MAX_KEYS_PER_CALL = 16384

# Page keys of this tier: SHA-256 of this tag, the namespace's seed and vLLM's offload key.
_KEY_TAG = b"kvtier/vllm-offload-key/v1\x00"


@dataclass
class Settings:
    """The tier's keys in its ``secondary_tiers`` entry (beside ``type`` and
    ``module_path``, which vLLM takes, and ``backpressure`` and ``locality``, vLLM's)."""

    # kvtierd's gRPC socket (its `server.socket`, by default <data_dir>/kvtierd.sock).
    socket: str = "kvtier-data/kvtierd.sock"
    # The model in the cache identity; empty: vLLM's model (its checkpoint path or hub id).
    model_id: str = ""
    # The weights' version, when one checkpoint name can hold different weights.
    weight_version: str = ""
    # A tenant name: pages are shared only among instances with the same one.
    tenant: str = ""
    # Deadline of each kvtierd call, in seconds.
    timeout_s: float = 5.0
    # Deadline of a lookup, in seconds; past it (or with kvtierd unreachable) the chunks are
    # misses, and for lookup_pause_s every lookup is a miss without asking.
    lookup_timeout_s: float = 1.0
    lookup_pause_s: float = 5.0
    # How long a store waits for room in L2 (its pages waiting for L3 writes) before the
    # rest of its pages are dropped and the job fails. 0: no wait.
    store_wait_s: float = 1.0
    # How a load waits for pages from L3: wait_complete or timeout (both end at
    # prefetch_timeout_s), or best_effort.
    prefetch_policy: str = "wait_complete"
    prefetch_timeout_s: float = 5.0
    # After kvtierd could not be reached, calls are misses for this long before the next try.
    reconnect_interval_s: float = 1.0
    # Threads copying loads, and stores, between vLLM's CPU region and kvtierd's pool.
    load_threads: int = 2
    store_threads: int = 2
    # Least time between two log lines of the same failure.
    log_interval_s: float = 10.0

    @staticmethod
    def parse(extra: dict[str, Any]) -> Settings:
        where = "secondary_tiers[kvtier]"
        s = Settings()
        fill(s, extra, where)
        if s.prefetch_policy not in POLICIES:
            raise ValueError(
                f"kvtier: {where}.prefetch_policy: {s.prefetch_policy!r} is not one of "
                f"{', '.join(POLICIES)}"
            )
        for name in ("timeout_s", "lookup_timeout_s", "prefetch_timeout_s"):
            if getattr(s, name) <= 0:
                raise ValueError(f"kvtier: {where}.{name}: must be above 0")
        for name in ("lookup_pause_s", "store_wait_s", "reconnect_interval_s"):
            if getattr(s, name) < 0:
                raise ValueError(f"kvtier: {where}.{name}: must not be negative")
        for name in ("load_threads", "store_threads"):
            if not 1 <= getattr(s, name) <= 64:
                raise ValueError(f"kvtier: {where}.{name}: must be 1 to 64")
        return s


@dataclass(frozen=True)
class _LinkSettings:
    """What :class:`PoolLink` reads of its settings."""

    # How long a store waits for room in L2 (PoolLink's name for it).
    timeout_s: float
    reconnect_interval_s: float
    prefetch_policy: str
    prefetch_timeout_s: float

    def load_budget_s(self, pages: int, page_tokens: int) -> float:
        return self.prefetch_timeout_s


class _Rows:
    """Rows of vLLM's CPU region, by chunk id, as :class:`PoolLink` copies pages: the ``i``-th
    key's page is row ``chunk_ids[i]``, whole (every worker's bytes and the padding)."""

    def __init__(self, base: int, stride: int, chunk_ids: Sequence[int]):
        self.base, self.stride, self.chunk_ids = base, stride, chunk_ids

    def to_slot(self, i: int, base: int) -> None:
        ctypes.memmove(base, self.base + self.chunk_ids[i] * self.stride, self.stride)

    def from_slot(self, i: int, base: int) -> None:
        ctypes.memmove(self.base + self.chunk_ids[i] * self.stride, base, self.stride)

    def part(self, at: int, n: int) -> _Rows:
        """The rows of keys ``at .. at + n``."""
        return _Rows(self.base, self.stride, self.chunk_ids[at : at + n])


def _parts(keys: list[bytes]) -> Iterable[tuple[int, list[bytes]]]:
    """``keys`` in runs of at most :data:`MAX_KEYS_PER_CALL`, each with where it starts."""
    for at in range(0, len(keys), MAX_KEYS_PER_CALL):
        yield at, keys[at : at + MAX_KEYS_PER_CALL]


@dataclass(frozen=True)
class _Done:
    """A job's end, from a copying thread to the scheduler's."""

    job_id: JobId
    # Leading keys done: stored, or loaded into their rows.
    done: int
    total: int
    seconds: float
    nbytes: int


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookups (one background thread, one batch per step), answered by
    kvtierd: whether each chunk is in L2 or L3."""

    def __init__(self, tier: KvtierTier):
        self._tier = tier
        self._paused_until = 0.0
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._present(keys, self)

    def pause(self, now: float) -> None:
        self._paused_until = now + self._tier.settings.lookup_pause_s

    def paused(self, now: float) -> bool:
        return now < self._paused_until


class KvtierTier(SecondaryTierManager):
    """A secondary tier of vLLM's ``TieringOffloadingManager`` backed by kvtierd."""

    # kvtierd's L2 is host memory on this node (L3 stands behind it).
    medium: ClassVar[Medium | None] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **settings: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self.settings = Settings.parse(settings)
        s = self.settings
        self.report = Reporter(s.log_interval_s, logger)
        self.counters = self.report.counters
        # The region: rows of `stride` bytes; the tier reads and writes them by address.
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8)
        self._num_rows = int(primary_kv_view.shape[0]) if primary_kv_view.shape else 0
        self._stride = self.block_size_bytes
        if self._rows.size != self._num_rows * self._stride:
            raise ValueError(
                f"kvtier: vLLM's CPU region is {self._rows.size} bytes, not {self._num_rows} "
                f"rows of {self._stride}"
            )
        self._base = int(self._rows.ctypes.data)
        config = offloading_spec.config
        self._instance = os.urandom(8).hex()
        descriptor, page_bytes = tier_descriptor(config, s, self._stride, self._instance)
        self.namespace = Namespace(tenant=s.tenant)
        # drain_jobs (vLLM's reset_cache: sleep, resume, a weight update) moves the tier to a
        # new epoch: nothing stored before is found by this instance again.
        self.epoch = WeightEpoch()
        self._seed = self.namespace.seed() or b""
        self.client = DaemonClient(s.socket, s.timeout_s)
        self.link = PoolLink(
            "vllm-offload",
            self.client,
            descriptor,
            page_bytes,
            self.namespace,
            f"vllm-tier-{config.engine_id}",
            self.report,
            _LinkSettings(
                s.store_wait_s, s.reconnect_interval_s, s.prefetch_policy, s.prefetch_timeout_s
            ),
        )
        # Scheduler thread only: jobs in flight, and the keys of loads (for mark_miss).
        self._inflight: dict[JobId, concurrent.futures.Future[None]] = {}
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._loaders = concurrent.futures.ThreadPoolExecutor(s.load_threads, "kvtier-tier-load")
        self._storers = concurrent.futures.ThreadPoolExecutor(s.store_threads, "kvtier-tier-store")
        self._lookups = _Lookups(self)
        # Register now: pages of a size kvtierd derives otherwise are an error at start-up.
        # kvtierd down (or refusing the layout) is not: logged, and the tier is all misses
        # until a later call registers.
        self.link.session()

    # ---- keys ---------------------------------------------------------------------------

    def page_keys(self, keys: Iterable[OffloadKey], seed: bytes | None = None) -> list[bytes]:
        """kvtier's page keys for vLLM's offload keys (block hash and group), in this tier's
        namespace: the tenant and the weight epoch."""
        pre = _KEY_TAG + (self._seed if seed is None else seed)
        return [hashlib.sha256(pre + bytes(k)).digest() for k in keys]

    # ---- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _present(self, keys: list[OffloadKey], lookups: _Lookups) -> list[bool]:
        """On the lookup thread: whether kvtierd holds each key, in L2 or L3. A failure is
        all misses, and pauses lookups."""
        now = time.monotonic()
        if lookups.paused(now):
            self.report.bump("lookups_skipped", len(keys))
            return [False] * len(keys)
        pkeys = self.page_keys(keys)
        with self.link.use() as s:
            if s is None:
                lookups.pause(now)
                return [False] * len(keys)
            try:
                found: list[bool] = []
                for at in range(0, len(pkeys), MAX_KEYS_PER_CALL):
                    part = pkeys[at : at + MAX_KEYS_PER_CALL]
                    found += s.lookup_each(part, True, timeout=self.settings.lookup_timeout_s)
                return found
            except Exception as e:  # noqa: BLE001 - never into vLLM's threads
                self.report.fail("lookup", e)
                self.link.drop(s, e)
                lookups.pause(now)
                return [False] * len(keys)

    # ---- jobs ---------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._storers, job_metadata.job_id, keys, rows, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        self._load_keys[job_metadata.job_id] = keys
        self._submit(self._loaders, job_metadata.job_id, keys, rows, self._load)

    def _submit(
        self,
        pool: concurrent.futures.ThreadPoolExecutor,
        job_id: JobId,
        keys: list[OffloadKey],
        rows: list[int],
        run: Callable[[list[bytes], _Rows], int],
    ) -> None:
        # The keys in the namespace of now: a job never straddles a reset.
        pkeys = self.page_keys(keys)

        def job() -> None:
            start = time.perf_counter()
            done = 0
            try:
                if len(rows) != len(keys) or any(not 0 <= r < self._num_rows for r in rows):
                    raise ValueError(f"{len(rows)} rows {rows[:4]}... for {len(keys)} keys")
                done = run(pkeys, _Rows(self._base, self._stride, rows))
            except Exception as e:  # noqa: BLE001 - a failed job, never a lost one
                self.report.fail("job", e)
            finally:
                seconds = time.perf_counter() - start
                self._done.put(_Done(job_id, done, len(keys), seconds, len(keys) * self._stride))

        try:
            self._inflight[job_id] = pool.submit(job)
        except RuntimeError as e:  # shut down
            self.report.fail("job", e)
            self._done.put(_Done(job_id, 0, len(keys), 0.0, 0))

    def _store(self, pkeys: list[bytes], rows: _Rows) -> int:
        ok: list[bool] = []
        copied = 0
        for at, part in _parts(pkeys):
            parent = pkeys[at - 1] if at else b""
            got, n = self.link.store(rows.part(at, len(part)), part, parent)
            ok += got
            copied += n
            if False in got:
                ok += [False] * (len(pkeys) - len(ok))
                break
        stored = ok.index(False) if False in ok else len(ok)
        self.report.bump("stored_pages", copied)
        if stored < len(ok):
            self.report.bump("store_failed_pages", len(ok) - stored)
        return stored

    def _load(self, pkeys: list[bytes], rows: _Rows) -> int:
        got = 0
        for at, part in _parts(pkeys):
            parent = pkeys[at - 1] if at else b""
            n = self.link.load(rows.part(at, len(part)), part, parent)
            got += n
            if n < len(part):
                break
        self.report.bump("loaded_pages", got)
        if got < len(pkeys):
            self.report.bump("load_missed_pages", len(pkeys) - got)
        return got

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        while True:
            try:
                d = self._done.get_nowait()
            except queue.Empty:
                return out
            self._inflight.pop(d.job_id, None)
            ok = d.done == d.total
            keys = self._load_keys.pop(d.job_id, None)
            successful: Collection[OffloadKey] | None = None
            if keys is not None and not ok:
                # The rows loaded before the first failure are kept; the rest are misses
                # from now on (vLLM recomputes them), not looked up and promoted again.
                successful = tuple(keys[: d.done]) or None
                self._lookups.mark_miss(keys[d.done :])
            out.append(
                JobResult(
                    job_id=d.job_id,
                    success=ok,
                    successful_keys=successful,
                    transfer_time=d.seconds,
                    transfer_bytes=d.nbytes or None,
                )
            )

    def has_pending_work(self) -> bool:
        return bool(self._inflight)

    def drain_jobs(self) -> None:
        """Waits for every job (each ends within its calls' deadlines); vLLM calls it from
        ``reset_cache``, after which this instance's pages are in a new weight epoch."""
        concurrent.futures.wait(list(self._inflight.values()))
        self.epoch.bump()
        self._seed = self.epoch.namespace(self.namespace).seed() or b""
        self.report.bump("resets")

    # ---- requests and steps -------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._loaders.shutdown(wait=True)
        self._storers.shutdown(wait=True)
        self.link.close()
        self.client.close()
        # The last view of vLLM's region this tier took: vLLM unmaps it next.
        self._rows = np.empty(0, np.uint8)
        self._base = 0


# vLLM's SecondaryTierFactory takes the class named by the entry's "type" from module_path.
kvtier = KvtierTier


# ---- identity ---------------------------------------------------------------------------


def tier_descriptor(
    config: OffloadingConfig, settings: Settings, stride: int, instance: str
) -> tuple[common_pb2.LayoutDescriptor, int]:
    """The layout the tier registers with kvtierd, and its page size in bytes: one page per
    row of vLLM's CPU region (``stride`` bytes), in the cache identity of vLLM's engine
    (:func:`engine_identity`, the connector's) with the row's format as its layout."""
    ident = tier_identity(config, settings, stride, instance)
    model_id, version = ident.descriptor_fields()
    tokens = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
    per_token = -(-stride // tokens)
    spec = LayoutSpec(
        model_id=model_id,
        model_version=version,
        dtype="uint8",
        num_layers=1,
        page_size=tokens,
        shape=State(per_token),
    )
    return spec.descriptor(), per_token * tokens


def row_format(config: OffloadingConfig, stride: int) -> str:
    """What decides a row's bytes beyond the model: vLLM's version, the region's layout
    (every worker's slot of a chunk side by side), the chunk's blocks and groups."""
    import vllm

    p = config.parallel
    groups = ";".join(
        f"g{g.group_id}:{g.tokens_per_block}:{layer_range(g.layer_names)}" for g in config.groups
    )
    return (
        f"vllm-{vllm.__version__}|offload-row|{stride}|{config.worker_kv_bytes_per_block}"
        f"|bpc={config.cache.blocks_per_chunk}|tph={config.cache.tokens_per_hash}"
        f"|world={p.world_size}|tp={p.tp_size}|pp={p.pp_size}|pcp={p.pcp_size}"
        f"|dcp={p.dcp_size}|replicated={config.replicated_layout}"
        f"|canonical={config.canonical_layout}|kv_layout={config.kv_cache_layout}|{groups}"
    )


def tier_identity(
    config: OffloadingConfig, settings: Settings, stride: int, instance: str
) -> CacheIdentity:
    """The cache identity of this engine's rows. vLLM hands a tier its offloading config,
    not its engine config; the engine config (revision, quantization, the HF config as vLLM
    resolved it) is the one its offloading connector was built with, found in the caller's
    frames. Where it is not found, the rows are this instance's alone (never shared)."""
    layers = [name for g in config.groups for name in g.layer_names]
    vllm_config = engine_config(config.model.name)
    layout = row_format(config, stride)
    if vllm_config is not None:
        return engine_identity(
            vllm_config, settings.model_id, settings.weight_version, instance, layers, layout
        )
    logger.warning(
        "kvtier: the tier found no vLLM engine config beside its offloading config; its "
        "pages are this instance's own, shared with no other"
    )
    return CacheIdentity(
        engine="vllm",
        model=settings.model_id or config.model.name,
        checkpoint=checkpoint_digest(config.model.name),
        weight_version=settings.weight_version,
        kv_dtype=config.model.dtype,
        layers=layer_range(layers),
        layout=layout,
        extra=f"instance={instance}",
    )


def engine_config(model: str) -> VllmConfig | None:
    """The ``VllmConfig`` of the engine whose model is ``model``, from the frames that are
    building this tier (vLLM's ``OffloadingConnectorScheduler`` holds it)."""
    from vllm.config import VllmConfig

    frame = inspect.currentframe()
    try:
        for _ in range(40):
            if frame is None:
                return None
            for v in list(frame.f_locals.values()):
                if isinstance(v, VllmConfig) and v.model_config.model == model:
                    return v
            frame = frame.f_back
        return None
    finally:
        del frame


__all__ = ["KvtierTier", "Settings", "kvtier"]
