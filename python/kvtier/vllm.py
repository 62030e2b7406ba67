"""kvtier as a vLLM KV connector: ``KvtierConnector``, loaded by vLLM with flags only::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"agent": "/run/kvtier/agent-{rank}.sock"}}'

vLLM keeps its own prefix cache over its KV blocks, so each worker's kvtier-agent runs in
engine-cache mode (proto/kvtier/v1/agent.proto): it keeps no tree, and the connector asks it

- on the scheduler side, how much of a waiting request's prompt past vLLM's own hits L2 and
  L3 hold (``Lookup``): that many tokens are reported as external hits, whole pages only,
  never the prompt's last token;
- on the worker side, before the forward pass, to load those pages into the blocks vLLM
  allocated (``Load``); a page not loaded is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes from there;
- after the forward pass, to save every block that became full in it (``Save``), under the
  agent's write policy, before vLLM may reuse it: saves are synchronous, so
  ``request_finished`` never holds blocks back.

Pages are keyed by kvtier's hash of their tokens (docs/hash-spec.md) in a namespace of the
tenant, vLLM's ``cache_salt`` and the LoRA adapter; the model, vLLM's block layout and the
tensor-parallel rank are in the layout fingerprint the agent registers with kvtierd, so
pages never cross models, layouts or ranks. vLLM's own block hashes are not used: they are
seeded per process unless PYTHONHASHSEED is set, so another worker could never find them.
Requests with multimodal inputs or prompt embeddings are not cached (their tokens do not
say what their KV is).

Bytes move by memcpy through a staging pool in shared memory that the agent maps (the
agent's "device"): a block is copied between vLLM's tensor and a staging page, and between
the staging page and L2 by the agent. On a GPU the first copy is a device-host copy.
docs/vllm.md has the settings, the sidecar setup and the failure behaviour.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.agent import AgentClient
from kvtier.host import POLICIES, KvtierError
from kvtier.keys import Namespace
from kvtier.settings import fill
from kvtier.v1 import common_pb2

logger = logging.getLogger(__name__)

__all__ = ["KvtierConnector", "Settings"]


@dataclass
class Settings:
    """The connector's settings, from ``kv_connector_extra_config``."""

    # The worker's kvtier-agent socket; "{rank}" is replaced by the worker's tensor-parallel
    # rank (the scheduler asks rank 0's agent).
    agent: str = "kvtier-data/kvtier-agent.sock"
    # Model identity in the layout fingerprint; empty: vLLM's served model name.
    model_id: str = ""
    # A tenant name: pages are shared only among workers with the same one.
    tenant: str = ""
    # Pages of the staging pool the agent copies through (per worker).
    staging_pages: int = 256
    # How a load waits for pages that must come from L3 first: wait_complete, timeout,
    # best_effort, or "" for kvtierd's prefetch.policy.
    load_policy: str = "wait_complete"
    # The timeout policy's deadline, in milliseconds (0: kvtierd's).
    load_timeout_ms: int = 0
    # Deadline of each agent call, in seconds (a load from L3 may take up to
    # load_timeout_ms on top).
    timeout_s: float = 10.0

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> Settings:
        where = "kv_connector_extra_config"
        s = Settings()
        fill(s, dict(extra or {}), where)
        if s.load_policy and s.load_policy not in POLICIES:
            raise ValueError(
                f"kvtier: {where}.load_policy: {s.load_policy!r} is not one of "
                f"{', '.join(POLICIES)} (or empty for kvtierd's)"
            )
        if s.staging_pages < 1:
            raise ValueError(f"kvtier: {where}.staging_pages: must be at least 1")
        if s.load_timeout_ms < 0:
            raise ValueError(f"kvtier: {where}.load_timeout_ms: must not be negative")
        if s.timeout_s <= 0:
            raise ValueError(f"kvtier: {where}.timeout_s: must be above 0")
        return s

    def agent_socket(self, rank: int) -> str:
        return self.agent.replace("{rank}", str(rank))


@dataclass
class Job:
    """Pages ``start..start+len(blocks)`` of a prompt, held in (or going to) ``blocks``."""

    req_id: str
    tokens: list[int]
    namespace: Namespace
    start: int
    blocks: list[int]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's work for the workers: loads before the forward pass, saves after it."""

    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)


@dataclass
class Counts:
    """What this connector did, for logs and tests (the agent's metrics have the rest).
    Scheduler side: tokens vLLM took as external hits. Worker side: pages loaded, pages a
    load missed (vLLM recomputed them), pages saved or already in L2, pages not saved."""

    external_tokens: int = 0
    loaded_pages: int = 0
    load_error_pages: int = 0
    saved_pages: int = 0
    save_failed_pages: int = 0


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: Any
    namespace: Namespace
    blocks: list[int] = field(default_factory=list)
    # Pages before this one are in L2 or were handed to a save.
    saved: int = 0


def namespace_of(request: Any, tenant: str) -> Namespace | None:
    """The request's namespace, or None when its tokens do not determine its KV."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    return Namespace(
        tenant=tenant,
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_id=lora.lora_name if lora is not None else "",
    )


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):
        return 0


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector over kvtier (see the module doc)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = Settings.parse(ktc.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            raise ValueError(
                "kvtier: kv_transfer_config.kv_load_failure_policy is "
                f"{ktc.kv_load_failure_policy!r}; set it to 'recompute': a page that leaves "
                "kvtier between lookup and load must be recomputed, not fail the request"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                f"kvtier: the model has {len(groups)} KV cache groups (hybrid attention); "
                "the connector supports models with one"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.rank = 0 if role == KVConnectorRole.SCHEDULER else _rank()
        self.agent = AgentClient(
            self.settings.agent_socket(self.rank), timeout=self.settings.timeout_s
        )
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, tuple[int, int]] = {}
        self._loads: list[Job] = []
        # Worker side.
        self._staging: _Staging | None = None
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self.counts = Counts()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        ns = namespace_of(request, self.settings.tenant)
        if ns is None:
            return 0, False
        bs = self.block_size
        tokens = list(request.all_token_ids)
        # vLLM computes at least the last token itself (it needs its logits).
        limit = (len(tokens) - 1) // bs
        start = num_computed_tokens // bs
        self._hits[request.request_id] = (start, 0)
        if start >= limit:
            return 0, False
        try:
            found = self.agent.lookup_pages(tokens[: limit * bs], ns, start)
        except KvtierError as e:
            logger.warning("kvtier: lookup failed, computing instead: %s", e)
            return 0, False
        n = min(found.l2_pages + found.l3_pages, limit - start)
        if n <= 0:
            return 0, False
        self._hits[request.request_id] = (start, n)
        return n * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        req_id = request.request_id
        ns = namespace_of(request, self.settings.tenant)
        hit = self._hits.pop(req_id, None)
        if ns is None:
            return
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        t = self._tracked.get(req_id)
        if t is None:
            t = self._tracked[req_id] = _Tracked(request, ns)
        if block_ids:
            t.blocks = block_ids
        bs = self.block_size
        start, n = hit if hit is not None else (request.num_computed_tokens // bs, 0)
        # Pages vLLM had and pages about to be loaded need no save.
        t.saved = max(t.saved, start + num_external_tokens // bs)
        if n <= 0 or num_external_tokens <= 0:
            return
        self.counts.external_tokens += num_external_tokens
        n = min(n, num_external_tokens // bs, len(block_ids) - start)
        if n > 0:
            tokens = list(request.all_token_ids[: (start + n) * bs])
            self._loads.append(Job(req_id, tokens, ns, start, block_ids[start : start + n]))

    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        meta = KvtierMetadata(loads=self._loads)
        self._loads = []
        for req_id, new_blocks, full_table in yield_req_data(scheduler_output):
            t = self._tracked.get(req_id)
            if t is None or new_blocks is None:
                continue
            if full_table:
                t.blocks = list(new_blocks[0])
            else:
                t.blocks.extend(new_blocks[0])
        bs = self.block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None:
                continue
            tokens = t.request.all_token_ids
            # Pages full after this step, whose tokens are all known now.
            done = min(t.request.num_computed_tokens + scheduled, len(tokens)) // bs
            done = min(done, len(t.blocks))
            if done > t.saved:
                meta.saves.append(
                    Job(
                        req_id,
                        list(tokens[: done * bs]),
                        t.namespace,
                        t.saved,
                        t.blocks[t.saved : done],
                    )
                )
                t.saved = done
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves ran in the step that computed each block: nothing to hold back.
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        layers = [_block_major(name, t, num_blocks) for name, t in kv_caches.items()]
        if not layers:
            raise ValueError("kvtier: vLLM registered no KV cache tensors")
        per_block = {int(t[0].numel() * t.element_size()) for t in layers}
        if len(per_block) != 1:
            raise ValueError(
                f"kvtier: KV layers of different sizes per block {sorted(per_block)}; "
                "the connector supports models whose layers are alike"
            )
        block_bytes = per_block.pop()
        if block_bytes % self.block_size:
            raise ValueError(
                f"kvtier: {block_bytes} bytes per block is not a whole number per token "
                f"(block size {self.block_size})"
            )
        self._layers = layers
        self._staging = _Staging(len(layers), self.settings.staging_pages, block_bytes)
        self._descriptor = self._layout(layers[0], block_bytes)
        self._register()

    def _layout(self, sample: torch.Tensor, block_bytes: int) -> common_pb2.LayoutDescriptor:
        vc = self._vllm_config
        mc = vc.model_config
        pc = vc.parallel_config
        import vllm

        # vLLM's bytes of a block are opaque to kvtier: a byte-typed state layout, with
        # vLLM's version and the block's shape and strides in the fingerprint, so pages only
        # load into a worker that lays blocks out the same way.
        block_shape = "x".join(str(d) for d in sample.shape[1:])
        order = ",".join(str(s) for s in sample.stride()[1:])
        layout = f"vllm-{vllm.__version__}|{sample.dtype}|{block_shape}|{order}"
        version = f"{mc.revision or ''}|{layout}"
        model = self.settings.model_id or mc.served_model_name or mc.model
        if isinstance(model, list):
            model = model[0]
        return common_pb2.LayoutDescriptor(
            model_id=str(model),
            model_version=version[:256],
            dtype=common_pb2.DTYPE_UINT8,
            num_layers=len(self._layers),
            state=common_pb2.StateShape(elems=block_bytes // self.block_size),
            page_size=self.block_size,
            tp_rank=self.rank,
            tp_size=pc.tensor_parallel_size,
        )

    def _register(self) -> None:
        assert self._staging is not None
        self.agent.register_pool(
            self._descriptor,
            self._staging.pages * self.block_size,
            cpu_path=self._staging.path,
            engine_cache=True,
        )

    def _call(self, fn):
        """An agent call; after an agent restart (the pool unknown to it) registers again
        and retries once."""
        try:
            return fn()
        except KvtierError as e:
            if "RegisterPool" not in str(e) or self._staging is None:
                raise
            logger.warning("kvtier: the agent lost the pool (restarted?); registering again")
        self._register()
        return fn()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata) or self._staging is None:
            return
        for job in meta.loads:
            for part in _chunks(job, self._staging.pages):
                self._load(part)

    def _load(self, job: Job) -> None:
        assert self._staging is not None
        n = len(job.blocks)
        slots = list(range(n))
        s = self.settings
        try:
            loaded = self._call(
                lambda: self.agent.load_pages(
                    job.tokens,
                    job.namespace,
                    job.start,
                    slots,
                    policy=s.load_policy or None,
                    timeout_ms=s.load_timeout_ms,
                    timeout=s.timeout_s + s.load_timeout_ms / 1000,
                ),
            )
        except KvtierError as e:
            logger.warning("kvtier: load of %d pages failed, vLLM recomputes: %s", n, e)
            loaded = 0
        loaded = max(0, min(loaded, n))
        if loaded:
            self._staging.to_blocks(self._layers, slots[:loaded], job.blocks[:loaded])
        self._load_errors.update(job.blocks[loaded:])
        self.counts.loaded_pages += loaded
        self.counts.load_error_pages += n - loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata) or self._staging is None:
            return
        for job in meta.saves:
            for part in _chunks(job, self._staging.pages):
                self._save(part)

    def _save(self, job: Job) -> None:
        assert self._staging is not None
        slots = list(range(len(job.blocks)))
        self._staging.from_blocks(self._layers, job.blocks, slots)
        try:
            r = self._call(
                lambda: self.agent.save_pages(job.tokens, job.namespace, job.start, slots),
            )
        except KvtierError as e:
            # The agent counts what it could not save; an agent that cannot be reached
            # cannot count, so it is said here.
            logger.warning("kvtier: save of %d pages failed: %s", len(slots), e)
            self.counts.save_failed_pages += len(slots)
            return
        self.counts.saved_pages += r.stored + r.present
        self.counts.save_failed_pages += r.failed
        if r.failed:
            logger.warning("kvtier: %d pages could not be saved to L2", r.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.agent.close()
        if self._staging is not None:
            self._staging.close()


def _chunks(job: Job, most: int) -> Iterator[Job]:
    """The job in pieces of at most ``most`` pages, in order."""
    for i in range(0, len(job.blocks), most):
        yield Job(job.req_id, job.tokens, job.namespace, job.start + i, job.blocks[i : i + most])


def _block_major(name: str, t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of a layer's KV with the block index first (vLLM's layouts put it first, or
    second after a K/V dimension of 2)."""
    for d in range(min(t.dim(), 2)):
        if t.shape[d] == num_blocks:
            return t.movedim(d, 0) if d else t
    raise ValueError(
        f"kvtier: KV layer {name!r} of shape {tuple(t.shape)} has no dimension of "
        f"{num_blocks} blocks among its first two"
    )


class _Staging:
    """The staging pool: a shared-memory file the agent maps as its cpu device, one buffer
    per layer, page p of layer l at ``(l * pages + p) * block_bytes``."""

    def __init__(self, layers: int, pages: int, block_bytes: int):
        self.layers, self.pages, self.block_bytes = layers, pages, block_bytes
        size = layers * pages * block_bytes
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, self.path = tempfile.mkstemp(prefix="kvtier-vllm-", dir=base)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self._map, dtype=torch.uint8).view(layers, pages, block_bytes)

    def from_blocks(self, layers: Sequence[torch.Tensor], blocks: list[int], slots: list[int]):
        """Copies vLLM blocks into staging pages."""
        idx = torch.tensor(blocks, dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long)
        for i, t in enumerate(layers):
            src = t.index_select(0, idx.to(t.device)).contiguous()
            self.view[i].index_copy_(0, dst, src.view(torch.uint8).reshape(len(blocks), -1).cpu())

    def to_blocks(self, layers: Sequence[torch.Tensor], slots: list[int], blocks: list[int]):
        """Copies staging pages into vLLM blocks."""
        src = torch.tensor(slots, dtype=torch.long)
        for i, t in enumerate(layers):
            idx = torch.tensor(blocks, dtype=torch.long, device=t.device)
            data = self.view[i].index_select(0, src).to(t.device)
            t.index_copy_(0, idx, data.view(t.dtype).reshape(len(blocks), *t.shape[1:]))

    def close(self) -> None:
        del self.view
        try:
            self._map.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
