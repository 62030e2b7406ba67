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
  agent's write policy, before vLLM may reuse it: saves are synchronous, so
  ``request_finished`` never holds blocks back.

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

import logging
import mmap
import os
import re
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
from kvtier.identity import CacheIdentity, WeightEpoch, config_digest
from kvtier.keys import Namespace
from kvtier.layout import LayoutSpec, State
from kvtier.settings import fill
from kvtier.v1 import common_pb2

logger = logging.getLogger(__name__)

__all__ = ["KvtierConnector", "Settings"]


@dataclass
class Settings:
    """The connector's settings, from ``kv_connector_extra_config``."""

    # The worker's kvtier-agent socket. Placeholders: {local_rank} (the worker's GPU on this
    # node, counted across DP ranks: one agent per GPU), {dp_rank}, {pp_rank}, {tp_rank}
    # ({rank} is {tp_rank}). The scheduler asks the agent of its DP rank's first worker.
    agent: str = "kvtier-data/kvtier-agent-{local_rank}.sock"
    # The model in the cache identity; empty: vLLM's model (its checkpoint path or hub id,
    # never the served alias).
    model_id: str = ""
    # The weights' version, when the same checkpoint name can hold different weights;
    # workers share pages only with workers that declare the same one.
    weight_version: str = ""
    # Directory of the staging pool's file (shared memory the agent maps); empty: /dev/shm.
    staging_dir: str = ""
    # Permission bits of the staging file, octal: "0600" when the agent runs as the worker's
    # uid; "0660" for an agent under another uid in the file's group (a sidecar: give the
    # directory that group and the setgid bit, as Kubernetes' fsGroup does).
    staging_mode: str = "0600"
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
        s.staging_file_mode()
        return s

    def staging_file_mode(self) -> int:
        """``staging_mode`` as bits; an error names the key unless it is octal, keeps the
        owner's read and write, and gives nothing to others."""
        where = "kv_connector_extra_config.staging_mode"
        try:
            mode = int(self.staging_mode, 8)
        except ValueError:
            raise ValueError(f"kvtier: {where}: {self.staging_mode!r} is not octal") from None
        if mode & ~0o660 or mode & 0o600 != 0o600:
            raise ValueError(
                f"kvtier: {where}: {self.staging_mode!r}: the owner must read and write, the "
                "group may, others may not (0600 or 0660; no execute bits)"
            )
        return mode

    def agent_socket(self, ranks: Ranks) -> str:
        """The agent socket of the worker at ``ranks``."""
        values = {
            "local_rank": ranks.local,
            "dp_rank": ranks.dp,
            "pp_rank": ranks.pp,
            "tp_rank": ranks.tp,
            "rank": ranks.tp,
        }

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in values:
                raise ValueError(
                    f"kvtier: kv_connector_extra_config.agent: unknown placeholder {{{name}}}; "
                    f"the placeholders are {', '.join('{' + k + '}' for k in values)}"
                )
            return str(values[name])

        return re.sub(r"\{([^{}]*)\}", sub, self.agent)


@dataclass(frozen=True)
class Ranks:
    """Where a worker sits: its TP, PP and DP ranks, and its GPU on the node."""

    tp: int = 0
    pp: int = 0
    dp: int = 0
    local: int = 0

    @staticmethod
    def of_worker(vllm_config: Any) -> Ranks:
        pc = vllm_config.parallel_config
        tp = _parallel_rank(lambda ps: ps.get_tensor_model_parallel_rank(), 0)
        pp = _parallel_rank(lambda ps: ps.get_pp_group().rank_in_group, 0)
        # Without vLLM's world group (one node assumed): vLLM's rank order, PP-major.
        local = _parallel_rank(
            lambda ps: ps.get_world_group().local_rank, pp * pc.tensor_parallel_size + tp
        )
        dp_local = getattr(pc, "data_parallel_rank_local", None) or 0
        # vLLM gives DP rank d of a node the GPUs d*world .. (d+1)*world - 1, and its
        # workers local ranks 0 .. world - 1 among them.
        return Ranks(
            tp=tp,
            pp=pp,
            dp=getattr(pc, "data_parallel_rank", 0) or 0,
            local=dp_local * pc.world_size + local,
        )

    @staticmethod
    def of_scheduler(vllm_config: Any) -> Ranks:
        """The ranks of the first worker (TP 0, PP 0) of the scheduler's DP rank."""
        pc = vllm_config.parallel_config
        dp_local = getattr(pc, "data_parallel_rank_local", None) or 0
        return Ranks(dp=getattr(pc, "data_parallel_rank", 0) or 0, local=dp_local * pc.world_size)


@dataclass
class Job:
    """Pages ``start..start+len(blocks)`` of a prompt, held in (or going to) ``blocks``."""

    req_id: str
    tokens: list[int]
    namespace: Namespace
    start: int
    blocks: list[int]
    # Saves: the write policy's selection as the scheduler's lookup answered it (pages
    # before it are saved), the same for every TP rank; None: each agent's policy decides.
    selected: int | None = None


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
    # Staging pools given up after a call that may have left a copy running in them.
    retired_staging: int = 0


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: Any
    namespace: Namespace
    blocks: list[int] = field(default_factory=list)
    # Pages before this one are in L2 or were handed to a save.
    saved: int = 0
    # The write policy's selection from the last lookup (see Job.selected).
    selected: int | None = None


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
        self.ranks = (
            Ranks.of_scheduler(vllm_config)
            if role == KVConnectorRole.SCHEDULER
            else Ranks.of_worker(vllm_config)
        )
        # MLA's latent is the same on every TP rank: stored once (rank 0 of each PP stage
        # saves), loaded by every rank.
        self.mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.saves = not self.mla or self.ranks.tp == 0
        self.epoch = WeightEpoch()
        # Names this instance where its pages are its own (scales computed at run time).
        self._instance = os.urandom(8).hex()
        self.agent = AgentClient(
            self.settings.agent_socket(self.ranks), timeout=self.settings.timeout_s
        )
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        # Per request: the first page past vLLM's own hits, the pages kvtier holds after
        # it, and the write policy's selection (Job.selected).
        self._hits: dict[str, tuple[int, int, int | None]] = {}
        self._loads: list[Job] = []
        # Worker side.
        self._staging: _Staging | None = None
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self.counts = Counts()

    # ------------------------------------------------------------------ scheduler side

    def _namespace(self, request: Any) -> Namespace | None:
        ns = namespace_of(request, self.settings.tenant)
        return None if ns is None else self.epoch.namespace(ns)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        ns = self._namespace(request)
        if ns is None:
            return 0, False
        bs = self.block_size
        tokens = list(request.all_token_ids)
        # vLLM computes at least the last token itself (it needs its logits).
        limit = (len(tokens) - 1) // bs
        start = num_computed_tokens // bs
        self._hits[request.request_id] = (start, 0, None)
        if start >= limit:
            return 0, False
        try:
            found = self.agent.lookup_pages(tokens[: limit * bs], ns, start)
        except KvtierError as e:
            logger.warning("kvtier: lookup failed, computing instead: %s", e)
            return 0, False
        n = max(0, min(found.l2_pages + found.l3_pages, limit - start))
        self._hits[request.request_id] = (start, n, found.save_pages)
        if n <= 0:
            return 0, False
        return n * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        req_id = request.request_id
        ns = self._namespace(request)
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
        if hit is None:
            hit = (request.num_computed_tokens // bs, 0, None)
        else:
            t.selected = hit[2]
        start, n, _ = hit
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
                        t.selected,
                    )
                )
                t.saved = done
        return meta

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update:
        moves this instance to a new weight epoch, so nothing stored before is served to it
        again, and forgets the loads and saves planned under the old one (their KV may be the
        old weights'). Pages in the shared tiers stay for other instances. The worker side
        keeps no state of its own to reset: every job carries its namespace."""
        if self._role != KVConnectorRole.SCHEDULER:
            return True
        self.epoch.bump()
        self._tracked.clear()
        self._hits.clear()
        self._loads = []
        logger.info("kvtier: connector cache reset: a new weight epoch; earlier pages unused")
        return True

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
        self._layer_names = list(kv_caches)
        self._block_bytes = block_bytes
        self._descriptor = self._layout(layers[0], block_bytes)
        self._staging = self._new_staging()
        self._register()

    def _new_staging(self) -> _Staging:
        return _Staging(
            len(self._layers),
            self.settings.staging_pages,
            self._block_bytes,
            self.settings.staging_dir,
            self.settings.staging_file_mode(),
        )

    def identity(self, sample: torch.Tensor) -> CacheIdentity:
        """This worker's cache identity (docs/identity.md)."""
        vc = self._vllm_config
        mc, cc, pc = vc.model_config, vc.cache_config, vc.parallel_config
        import vllm

        model = self.settings.model_id or mc.model
        kv_dtype = str(cc.cache_dtype)
        if kv_dtype == "auto":
            kv_dtype = str(mc.dtype).removeprefix("torch.")
        scales = ""
        if kv_dtype.startswith(("fp8", "nvfp4")):
            # Scales read from the checkpoint are part of the model; scales computed from the
            # first batch are this instance's own, so its pages are its own too.
            scales = (
                f"calculated/{self._instance}"
                if getattr(cc, "calculate_kv_scales", False)
                else "checkpoint"
            )
        shards = []
        for name, size_attr, rank_fn in (
            ("dcp", "decode_context_parallel_size", "get_decode_context_model_parallel_rank"),
            ("pcp", "prefill_context_parallel_size", "get_prefill_context_model_parallel_rank"),
        ):
            size = int(getattr(pc, size_attr, 1) or 1)
            if size > 1:
                rank = _parallel_rank(lambda ps, fn=rank_fn: getattr(ps, fn)())
                shards.append(f"{name}{rank}of{size}")
        # vLLM's bytes of a block are opaque to kvtier: its version and the block's shape
        # and strides keep apart workers that lay blocks out differently.
        block_shape = "x".join(str(d) for d in sample.shape[1:])
        order = ",".join(str(st) for st in sample.stride()[1:])
        return CacheIdentity(
            engine="vllm",
            model=str(model),
            revision=str(mc.revision or ""),
            config=config_digest(getattr(mc, "hf_config", None), getattr(mc, "quantization", None)),
            weight_version=self.settings.weight_version,
            kv_dtype=kv_dtype,
            kv_scales=scales,
            layers=_layer_range(self._layer_names),
            shards="/".join(shards),
            layout=f"vllm-{vllm.__version__}|{sample.dtype}|{block_shape}|{order}",
        )

    def _layout(self, sample: torch.Tensor, block_bytes: int) -> common_pb2.LayoutDescriptor:
        pc = self._vllm_config.parallel_config
        model_id, version = self.identity(sample).descriptor_fields()
        return LayoutSpec(
            model_id=model_id,
            model_version=version,
            dtype="uint8",
            num_layers=len(self._layers),
            page_size=self.block_size,
            shape=State(block_bytes // self.block_size),
            tp_rank=0 if self.mla else self.ranks.tp,
            tp_size=1 if self.mla else pc.tensor_parallel_size,
        ).descriptor()

    def _register(self) -> None:
        assert self._staging is not None
        info = self.agent.register_pool(
            self._descriptor,
            self._staging.pages * self.block_size,
            cpu_path=self._staging.path,
            engine_cache=True,
        )
        if not info.daemon_connected:
            logger.warning(
                "kvtier: the agent at %s has no kvtierd session yet; saves wait for it",
                self.agent.address,
            )

    def _call(self, fn):
        """An agent call; after an agent restart (the pool unknown to it) registers again
        and retries once."""
        try:
            return fn()
        except KvtierError as e:
            if not e.pool_lost or self._staging is None:
                raise
            logger.warning("kvtier: the agent lost the pool (restarted?); registering again")
        self._register()
        return fn()

    def _retire_staging(self, why: KvtierError) -> None:
        """After a call that may have left the agent copying in the staging pool (a timeout,
        a dropped connection), that pool is never written again: a new one is registered
        and the old one is the agent's until its copy ends."""
        if why.refused or self._staging is None:
            return
        old = self._staging
        self.counts.retired_staging += 1
        # Until the new pool is registered, calls present no owner token: the agent refuses
        # them rather than serve them against the old pool.
        self.agent.forget_registration()
        try:
            self._staging = self._new_staging()
            old.close()
            self._register()
        except (KvtierError, OSError, ValueError) as e:
            logger.warning("kvtier: could not register a new staging pool: %s", e)

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
            self._retire_staging(e)
            loaded = 0
        loaded = max(0, min(loaded, n))
        if loaded:
            try:
                self._staging.to_blocks(self._layers, slots[:loaded], job.blocks[:loaded])
            except Exception as e:  # noqa: BLE001 - a failed copy is a miss, never a dead worker
                logger.warning("kvtier: copying %d loaded pages failed: %s", loaded, e)
                loaded = 0
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
        if not isinstance(meta, KvtierMetadata) or self._staging is None or not self.saves:
            return
        for job in meta.saves:
            for part in _chunks(job, self._staging.pages):
                self._save(part)

    def _save(self, job: Job) -> None:
        assert self._staging is not None
        slots = list(range(len(job.blocks)))
        try:
            self._staging.from_blocks(self._layers, job.blocks, slots)
        except Exception as e:  # noqa: BLE001 - a failed copy is a skipped save, never a dead worker
            logger.warning("kvtier: copying %d pages to staging failed: %s", len(slots), e)
            self.counts.save_failed_pages += len(slots)
            return
        try:
            r = self._call(
                lambda: self.agent.save_pages(
                    job.tokens, job.namespace, job.start, slots, selected=job.selected
                ),
            )
        except KvtierError as e:
            # The agent counts what it could not save; an agent that cannot be reached
            # cannot count, so it is said here.
            logger.warning("kvtier: save of %d pages failed: %s", len(slots), e)
            self.counts.save_failed_pages += len(slots)
            self._retire_staging(e)
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


def _parallel_rank(get: Any, default: int = 0) -> int:
    """A rank from vLLM's parallel state (``get(parallel_state)``), or ``default`` where
    that state is not set up (a process without vLLM's distributed groups)."""
    try:
        from vllm.distributed import parallel_state

        return int(get(parallel_state))
    except (AssertionError, ImportError, RuntimeError, AttributeError, TypeError):
        return default


def _layer_range(names: Sequence[str]) -> str:
    """The model layers a worker holds, from vLLM's layer names ("model.layers.7.attn"):
    "first-last" when contiguous, else a digest of the indices."""
    idx = []
    for n in names:
        m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", n)
        if m is None:
            return "names:" + config_digest(sorted(names))
        idx.append(int(m.group(1)))
    idx.sort()
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return f"{idx[0]}-{idx[-1]}"
    return "set:" + config_digest(idx)


def _chunks(job: Job, most: int) -> Iterator[Job]:
    """The job in pieces of at most ``most`` pages, in order."""
    for i in range(0, len(job.blocks), most):
        yield Job(
            job.req_id,
            job.tokens,
            job.namespace,
            job.start + i,
            job.blocks[i : i + most],
            job.selected,
        )


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
    per layer, page p of layer l at ``(l * pages + p) * block_bytes``. Its space is allocated
    up front (posix_fallocate): a tmpfs too small for it is an error here, naming the size
    and the directory, not a SIGBUS on the first save."""

    def __init__(
        self, layers: int, pages: int, block_bytes: int, directory: str = "", mode: int = 0o600
    ):
        self.layers, self.pages, self.block_bytes = layers, pages, block_bytes
        size = layers * pages * block_bytes
        base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        if not os.path.isdir(base):
            raise ValueError(
                f"kvtier: kv_connector_extra_config.staging_dir: {base!r} is not a directory"
            )
        fd, self.path = tempfile.mkstemp(prefix="kvtier-vllm-", dir=base)
        try:
            # Explicitly, whatever the umask: only the agent (the owner, or its group) opens it.
            os.fchmod(fd, mode)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(self.path)
                raise ValueError(
                    f"kvtier: the staging pool needs {size} bytes ({pages} pages of "
                    f"{block_bytes} bytes in {layers} layers) in {base}, which could not "
                    f"allocate them ({e.strerror}); free space there, set "
                    "kv_connector_extra_config.staging_dir to a larger directory, or lower "
                    "staging_pages"
                ) from None
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
