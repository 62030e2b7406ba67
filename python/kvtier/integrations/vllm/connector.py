"""kvtier as a vLLM KV connector: ``KvtierConnector``, loaded by vLLM with flags only::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"agent": "/run/kvtier/agent-{local_rank}.sock"}}'

vLLM keeps its own prefix cache over its KV blocks, so each worker's kvtier-agent runs in
engine-cache mode (proto/kvtier/v1/agent.proto): it keeps no tree, and the connector asks it

- on the scheduler side, how much of a waiting request's prompt past vLLM's own hits L2 and
  L3 hold (``Lookup``): that many tokens are reported as external hits, whole pages only,
  never the prompt's last token;
- on the worker side, before the forward pass, to load those pages into the blocks vLLM
  allocated (``Load``); a page not loaded is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes from there;
- after the forward pass, to save every block that became full in it (``Save``), under the
  agent's write policy, on a save thread.

Blocks move one of two ways (``transfer``): on a GPU, the agent copies them itself from the
KV cache the worker exported once by CUDA IPC handle (``dma``: no staging, nothing copied on
the worker's side; a finished request's blocks are held until its saves are done, and a
preemption waits for the saves of its blocks); otherwise, or when the agent's import fails
its check (logged, counted ``dma_fallbacks``), through a staging pool in shared memory that
the worker copies into and the agent maps (``staging``).

Pages are keyed by kvtier's hash of their tokens (docs/hash-spec.md) in a namespace of the
tenant, vLLM's ``cache_salt``, the LoRA adapter and the weight epoch (``reset_cache`` starts a
new one); the rest of the cache identity (docs/identity.md: the checkpoint, never the served
alias; its config; the KV cache dtype with its fp8 format; the pipeline stage's layers; the TP
rank unless the model is MLA; vLLM's block layout) is in the layout fingerprint the worker
registers, so pages never cross any of them. vLLM's own block hashes are not used: they are
seeded per process unless PYTHONHASHSEED is set, so another worker could never find them.

Each worker reaches its own agent: the socket template's ``{local_rank}`` (the default) is
the worker's GPU on the node, counted across DP ranks, so DP ranks and PP stages never share
an agent; an agent serves only the client that registered its pool.
Requests with multimodal inputs or prompt embeddings are not cached (their tokens do not
say what their KV is).

Bytes move by memcpy through a staging pool in shared memory that the agent maps (the
agent's "device"): a block is copied between vLLM's tensor and a staging page, and between
the staging page and L2 by the agent. On a GPU the first copy is a device-host copy.
docs/vllm.md has the settings, the sidecar setup and the failure behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.agent import AgentClient
from kvtier.integrations.vllm.common import (
    Counts,
    KvtierMetadata,
    Ranks,
    Settings,
    StepsDone,
    check_kv_cache_groups,
    check_parallel,
    overlapped_steps,
)
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.stats import KvtierPromMetrics, KvtierStats
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector over kvtier (see the module doc). vLLM builds one per role: its
    calls go to the :class:`SchedulerSide` in the scheduler process and to the
    :class:`WorkerSide` in each worker."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None, "vLLM builds a KV connector only with a kv_transfer_config"
        self.settings = Settings.parse(ktc.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            raise ValueError(
                "kvtier: kv_transfer_config.kv_load_failure_policy is "
                f"{ktc.kv_load_failure_policy!r}; set it to 'recompute': a page that leaves "
                "kvtier between lookup and load must be recomputed, not fail the request"
            )
        check_kv_cache_groups(kv_cache_config)
        check_parallel(vllm_config)
        block_size = vllm_config.cache_config.block_size
        self.ranks = (
            Ranks.of_scheduler(vllm_config)
            if role == KVConnectorRole.SCHEDULER
            else Ranks.of_worker(vllm_config)
        )
        self.agent = AgentClient(
            self.settings.agent_socket(self.ranks), timeout=self.settings.timeout_s
        )
        self.counts = Counts()
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        # kv_role: kv_both and kv_producer save; kv_both and kv_consumer load.
        produces = ktc.is_kv_producer
        if role == KVConnectorRole.SCHEDULER:
            device = str(getattr(vllm_config.device_config, "device_type", "") or "")
            self.scheduler = SchedulerSide(
                self.settings,
                block_size,
                self.agent,
                self.counts,
                produces,
                holds=self.settings.holds_blocks(device),
                consumes=ktc.is_kv_consumer,
                overlapped_steps=overlapped_steps(vllm_config),
                dma=self.settings.may_dma(device),
            )
        else:
            self.worker = WorkerSide(
                vllm_config, kv_cache_config, self.settings, self.ranks, self.agent, self.counts
            )
            self.worker.saves = self.worker.saves and produces

    @property
    def requires_kv_delivery(self) -> bool:
        """kvtier is a cache: a save that a preemption drops is a later miss, never lost
        output, so vLLM need not recompute a preempted request for its sake."""
        return False

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("kvtier: a scheduler call reached a worker's connector")
        return self.scheduler

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("kvtier: a worker call reached the scheduler's connector")
        return self.worker

    def _meta(self) -> KvtierMetadata | None:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvtierMetadata) else None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # vLLM binds its KV cache manager to the scheduler's connector (bind_kv_cache_manager).
        cache = getattr(self, "_kv_cache_manager", None)
        self._scheduler().update_connector_output(connector_output, cache)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update: the
        scheduler side moves to a new weight epoch (:meth:`SchedulerSide.reset_cache`). The
        worker side keeps no state of its own to reset: every job carries its namespace."""
        if self.scheduler is not None:
            self.scheduler.reset_cache()
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request), None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step reuses preempted requests' blocks: saves still reading them
        finish first."""
        if isinstance(kv_connector_metadata, KvtierMetadata) and kv_connector_metadata.preempted:
            self._worker().handle_preemptions(kv_connector_metadata.preempted)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The step whose loads before the forward pass this worker ran (``StepsDone``):
        the scheduler side saves what was computed over them once it has every rank's."""
        meta = self._meta()
        if meta is None or not meta.has_sync_loads():
            return None
        return StepsDone(frozenset({meta.step}))

    # ------------------------------------------------------------------ stats

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        return self._scheduler().get_external_cache_hit_sources(request, num_external_tokens)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self.worker is None else self.worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvtierStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        self.agent.close()
        if self.worker is not None:
            self.worker.shutdown()
