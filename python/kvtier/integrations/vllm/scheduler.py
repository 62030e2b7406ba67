"""The scheduler side of the vLLM connector: how much of a waiting request's prompt past
vLLM's own hits L2 and L3 hold (the agent's ``Lookup``), the loads vLLM accepted, and, each
step, the saves of every block that became full (handed to the workers in
:class:`~kvtier.integrations.vllm.common.KvtierMetadata`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

from kvtier.agent import AgentClient
from kvtier.host import KvtierError
from kvtier.identity import WeightEpoch
from kvtier.integrations.vllm.common import Counts, Job, KvtierMetadata, Settings
from kvtier.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: Request
    namespace: Namespace
    blocks: list[int] = field(default_factory=list)
    # Pages before this one are in L2 or were handed to a save.
    saved: int = 0
    # The write policy's selection from the last lookup (see Job.selected).
    selected: int | None = None


def namespace_of(request: Request, tenant: str) -> Namespace | None:
    """The request's namespace, or None when its tokens do not determine its KV."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    return Namespace(
        tenant=tenant,
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_id=lora.lora_name if lora is not None else "",
    )


class SchedulerSide:
    """The connector in vLLM's scheduler process."""

    def __init__(
        self,
        settings: Settings,
        block_size: int,
        agent: AgentClient,
        counts: Counts,
        produces: bool = True,
    ):
        self.settings, self.block_size, self.agent, self.counts = (
            settings,
            block_size,
            agent,
            counts,
        )
        # kv_role kv_consumer: this instance only loads; it plans no saves.
        self.produces = produces
        self.epoch = WeightEpoch()
        self._tracked: dict[str, _Tracked] = {}
        # Per request: the first page past vLLM's own hits, the pages kvtier holds after
        # it, and the write policy's selection (Job.selected).
        self._hits: dict[str, tuple[int, int, int | None]] = {}
        self._loads: list[Job] = []

    def _namespace(self, request: Request) -> Namespace | None:
        ns = namespace_of(request, self.settings.tenant)
        return None if ns is None else self.epoch.namespace(ns)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
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

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks | None, num_external_tokens: int
    ) -> None:
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
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
            if not self.settings.save_decode:
                # Pages of the prompt only: a page past it holds generated tokens.
                done = min(done, t.request.num_prompt_tokens // bs)
            if not self.produces:
                continue
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

    def reset_cache(self) -> None:
        """Moves this instance to a new weight epoch, so nothing stored before is served to
        it again, and forgets the loads and saves planned under the old one (their KV may be
        the old weights'). Pages in the shared tiers stay for other instances."""
        self.epoch.bump()
        self._tracked.clear()
        self._hits.clear()
        self._loads = []
        logger.info("kvtier: connector cache reset: a new weight epoch; earlier pages unused")

    def request_finished(self, request: Request) -> None:
        # Saves ran in the step that computed each block: nothing to hold back.
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
