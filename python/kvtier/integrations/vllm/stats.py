"""The connector's transfer figures inside vLLM's own stats: each worker's loads and saves
of an interval (:class:`KvtierStats`, returned by ``get_kv_connector_stats`` and carried to
the scheduler with the step's output), summed over workers by vLLM, logged by its stat
logger (``KV Transfer metrics: ...``) and exported on its Prometheus endpoint
(:class:`KvtierPromMetrics`, ``vllm:kvtier_*``).

Hits are reported to vLLM by tier through ``get_external_cache_hit_sources``: pages L2 held
as ``host``, pages from L3 as ``disk``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvtier.integrations.vllm.common import Counts

# The counters an interval sums, each exported as vllm:kvtier_<name>_total.
COUNTERS: dict[str, str] = {
    "loaded_pages": "Pages loaded into vLLM's blocks from kvtier (L2, or L3 through L2).",
    "loaded_bytes": "Bytes loaded into vLLM's blocks from kvtier.",
    "load_error_pages": "Pages a load did not deliver; vLLM recomputed them.",
    "saved_pages": "Pages saved to L2 (copied, or already there).",
    "saved_bytes": "Bytes of the pages saved to L2.",
    "save_failed_pages": "Pages a save did not get into L2 (L2 full or unreachable).",
    "save_dropped_pages": "Pages not saved: no staging page was free (saves were behind).",
    "save_preempted_pages": "Pages not saved: their request was preempted before the save "
    "thread copied them, and vLLM reused the blocks after waiting timeout_s.",
    "dma_fallbacks": "Workers with the KV cache on a GPU that copy through a staging pool "
    "because the agent could not copy their blocks directly (transfer auto).",
    "load_settle_waits": "Failed DMA loads whose blocks the worker held past one Cancel, "
    "until the agent (stopped or too busy) stopped copying into them.",
}
# Per-call durations, each exported as the histogram vllm:kvtier_<name>_seconds.
DURATIONS: dict[str, str] = {
    "load": "Time of one load: the agent's Load (L3 fetch included) and the copy to blocks.",
    "save": "Time of one step's saves on the save thread: the agent's SaveBatch into L2.",
}


@dataclass
class KvtierStats(KVConnectorStats):
    """One interval's figures: ``data = {"counts": {name: n}, "seconds": {op: [s, ...]}}``
    (plain values: vLLM sends it from the workers to the scheduler and its loggers)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counts": {}, "seconds": {}}

    def count(self, **add: int) -> None:
        counts = self.data.setdefault("counts", {})
        for k, v in add.items():
            if v:
                counts[k] = counts.get(k, 0) + v

    def took(self, op: str, seconds: float) -> None:
        self.data.setdefault("seconds", {}).setdefault(op, []).append(seconds)

    def is_empty(self) -> bool:
        return not self.data.get("counts") and not any(self.data.get("seconds", {}).values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        self.count(**other.data.get("counts", {}))
        for op, xs in other.data.get("seconds", {}).items():
            self.data.setdefault("seconds", {}).setdefault(op, []).extend(xs)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data.get("counts", {}))
        for op, xs in sorted(self.data.get("seconds", {}).items()):
            if xs:
                out[f"{op}_calls"] = len(xs)
                out[f"{op}_avg_ms"] = round(sum(xs) / len(xs) * 1e3, 3)
        return out


class Tally:
    """What one worker's transfers did: its :class:`Counts` for logs and tests, this
    interval's :class:`KvtierStats` for vLLM, and the blocks loads did not fill since vLLM
    last asked. Shared by the worker and its transfer, from any thread."""

    def __init__(self, counts: Counts):
        self.counts = counts
        self._lock = threading.Lock()
        self._stats = KvtierStats()
        self._load_errors: set[int] = set()

    def count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                setattr(self.counts, k, getattr(self.counts, k) + v)
            self._stats.count(**{k: v for k, v in add.items() if k in COUNTERS})

    def took(self, op: str, since: float) -> None:
        """One ``op`` call that began at ``since`` (``time.monotonic``) ended now."""
        with self._lock:
            self._stats.took(op, time.monotonic() - since)

    def missed(self, blocks: Sequence[int]) -> None:
        """Blocks a load did not fill: reported to vLLM, which recomputes from the first."""
        with self._lock:
            self._load_errors.update(blocks)
        self.count(load_error_pages=len(blocks))

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> KvtierStats | None:
        """This interval's figures (then a new interval starts); None when there are none."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KvtierStats()
        return out


class KvtierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_*`` on vLLM's Prometheus endpoint, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types its metric classes as one union; these are its Counter and Histogram
        # (or their multiprocess-safe stand-ins).
        counter = cast("type[Counter]", self._counter_cls)
        histogram = cast("type[Histogram]", self._histogram_cls)
        self._counters = {
            name: counter(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        buckets = [1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0]
        self._durations = {
            op: histogram(
                name=f"vllm:kvtier_{op}_seconds",
                documentation=doc,
                labelnames=labelnames,
                buckets=buckets,
            )
            for op, doc in DURATIONS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, n in transfer_stats_data.get("counts", {}).items():
            if name in self._counters and n:
                self._counters[name].labels(*labels).inc(n)
        for op, xs in transfer_stats_data.get("seconds", {}).items():
            h = self._durations.get(op)
            if h is not None:
                for x in xs:
                    h.labels(*labels).observe(x)
