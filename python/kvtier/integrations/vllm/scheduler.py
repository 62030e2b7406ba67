"""The scheduler side of the vLLM connector: how much of a waiting request's prompt past
vLLM's own hits L2 and L3 hold (the agent's ``Lookup``), the loads vLLM accepted, and, each
step, the saves of every block that became full (handed to the workers in
:class:`~kvtier.integrations.vllm.common.KvtierMetadata`).

Nothing here waits on the agent. A request's first ``get_num_new_matched_tokens`` starts its
lookup on a background thread (one of four; each lookup has its own deadline) and answers
``None`` ("ask again"); vLLM skips the request for that pass and asks again on a later one,
when the answer is there. The lookup sends the
prompt once and brings back its page keys; every later call for the request (loads, saves,
lookups after a preemption) names its pages by the key of the page before them and carries
only their tokens. Those tokens are a :class:`~kvtier.tokens.TokenWindow` of the request's
own token list, never copied on vLLM's scheduler thread: the thread that sends the call packs
them (a window pickled to another process goes as packed bytes). Keys of pages past the
prompt are hashed here as the request grows, one page at a time.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.agent import After, AgentClient, Lookup
from kvtier.host import KvtierError
from kvtier.identity import WeightEpoch
from kvtier.integrations.vllm.common import Counts, Job, KvtierMetadata, Settings, StepsDone
from kvtier.integrations.vllm.identity import lora_id
from kvtier.integrations.vllm.lookups import LookupBreaker, LookupThreads, PendingLookup
from kvtier.keys import KEY_BYTES, Namespace, extend_keys
from kvtier.tokens import TokenWindow

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")

# A lookup's answer older than this is asked again: pages may have left L2 meanwhile.
LOOKUP_MAX_AGE_S = 2.0

# Threads that send lookups, each with its own deadline: one slow answer holds up no other.
LOOKUP_THREADS = 4


class Keys:
    """The keys of a request's leading pages known so far: the runs of keys as the agent
    returned them (or as hashed here), kept as they came. Never copied into one buffer: at
    128k tokens a lookup's keys are 256 KiB, and appending them to a buffer took 0.5 ms of
    the scheduler thread in vLLM's process (a run is referenced, not copied)."""

    def __init__(self) -> None:
        self._runs: list[bytes] = []
        # Keys known through each run (cumulative), for finding a page's run.
        self._ends: list[int] = []

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, page: int) -> bytes:
        if not 0 <= page < len(self):
            raise IndexError(page)
        i = bisect.bisect_right(self._ends, page)
        off = (page - (self._ends[i - 1] if i else 0)) * KEY_BYTES
        return self._runs[i][off : off + KEY_BYTES]

    def _add(self, run: bytes) -> None:
        if not run:
            return
        self._runs.append(run)
        self._ends.append(len(self) + len(run) // KEY_BYTES)

    def merge(self, first: int, packed: bytes) -> None:
        """Adds keys of pages ``first..`` (``packed``) past those known; a run that does not
        reach the known ones is ignored."""
        have = len(self)
        if first > have:
            return
        skip = (have - first) * KEY_BYTES
        if skip < len(packed):
            self._add(packed[skip:] if skip else bytes(packed))

    def parent_of(self, page: int) -> bytes | None:
        """The key of page ``page - 1`` (None for page 0)."""
        return self[page - 1] if page > 0 else None

    def extend_to(self, pages: int, tokens: Sequence[int], ns: Namespace, bs: int) -> None:
        """Hashes the keys of pages up to ``pages`` that are not known yet: only those."""
        have = len(self)
        if have >= pages:
            return
        new = _slice(tokens, have * bs, pages * bs)
        self._add(b"".join(extend_keys(self.parent_of(have), new, bs, ns)))


@dataclass(frozen=True)
class _Hit:
    start: int
    pages: int = 0
    selected: int | None = None
    load_async: bool = False
    # Of ``pages``, the leading ones L2 holds (the rest come from L3).
    l2_pages: int = 0


@dataclass(slots=True)
class _Tracked:
    """A request, as the scheduler side follows it."""

    request: Request
    namespace: Namespace
    keys: Keys = field(default_factory=Keys)
    blocks: list[int] = field(default_factory=list)
    # Pages before this one are in L2 or were handed to a save.
    saved: int = 0
    # The write policy's selection from the last lookup (see Job.selected).
    selected: int | None = None
    lookup: PendingLookup[tuple[Lookup, int]] | None = None
    # The answer vLLM was given: first page past vLLM's hits, pages kvtier holds after it,
    # the policy's selection, and whether the load was announced as asynchronous.
    hit: _Hit | None = None
    # Allocated by vLLM (update_state_after_alloc ran).
    running: bool = False
    # The external hit tokens vLLM took, by tier (get_external_cache_hit_sources).
    sources: dict[CacheHitSource, int] = field(default_factory=dict)
    # The step of a load before the forward pass whose result on every rank has not come
    # back yet: nothing computed over it is saved until it does (a rank whose load fell
    # short computed garbage, and with TP the all-reduce spreads it to every rank).
    unconfirmed: int | None = None
    # The first page a load of this request failed at (on any rank): never offered to it
    # again, so it computes from there. Before: a page TP rank 0's agent holds and rank 1's
    # lacks was looked up, loaded, failed and looked up again forever (fuzz seed 982391475).
    load_failed_at: int | None = None


class _Filling:
    """The blocks one load before a step's forward pass fills, as vLLM's block objects;
    their ids are read once, when an allocation first asks whether it shares one."""

    __slots__ = ("blocks", "_ids")

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.blocks = blocks
        self._ids: set[int] | None = None

    def ids(self) -> set[int]:
        if self._ids is None:
            self._ids = {b.block_id for b in self.blocks}
        return self._ids


@dataclass(slots=True)
class _PlannedLoad:
    """A load vLLM accepted in this pass, whose block ids the step's output brings."""

    tracked: _Tracked
    job: Job
    # The request's blocks at allocation, as vLLM's block objects (read if the output
    # lacks the request's block table).
    blocks: Sequence[KVCacheBlock]
    pages: int

    def finish(self, tables: dict[str, list[int]]) -> Job:
        """The job with its block ids: from the request's whole block table in this step's
        output (``tables``; vLLM lists those ids for its workers anyway), else read from the
        blocks."""
        j = self.job
        if not j.blocks:
            table = tables.get(j.req_id)
            if table is None or len(table) < j.start + self.pages:
                table = self.tracked.blocks = [b.block_id for b in self.blocks]
            j.blocks = table[j.start : j.start + self.pages]
        return j


def _slice(tokens: Sequence[int], start: int, end: int) -> list[int]:
    """``tokens[start:end]`` as a list, copied once (vLLM's token lists slice to lists)."""
    part = tokens[start:end]
    return part if isinstance(part, list) else list(part)


def namespace_of(request: Request, tenant: str) -> Namespace | None:
    """The request's namespace, or None when its tokens do not determine its KV."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    adapter = ""
    if lora is not None:
        try:
            adapter = lora_id(lora)
        except OSError as e:
            # Its content cannot be read: not cached, rather than keyed by name alone.
            logger.warning("kvtier: LoRA adapter %s unreadable, not cached: %s", lora, e)
            return None
    return Namespace(
        tenant=tenant,
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_id=adapter,
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
        holds: bool = False,
        consumes: bool = True,
        overlapped_steps: bool = False,
        dma: bool = False,
    ):
        self.settings, self.block_size, self.agent, self.counts = (
            settings,
            block_size,
            agent,
            counts,
        )
        # kv_role kv_consumer: this instance only loads; it plans no saves. kv_producer: it
        # only saves; it looks nothing up and loads nothing.
        self.produces = produces
        self.consumes = consumes
        # "auto", "always" or "never" (Settings.load_mode): always where vLLM runs a step
        # before the previous one's output is back, and where the agent may write loads
        # into vLLM's blocks itself (``dma``).
        self.load_mode = settings.load_mode(overlapped_steps, dma)
        # The number of the next step (KvtierMetadata.step), and the requests whose loads
        # before that step's forward pass wait for its result (StepsDone).
        self._step = 0
        self._unconfirmed: dict[int, list[str]] = {}
        # Blocks such loads fill, by step: vLLM's prefix cache shares them with other
        # requests at once, and what those compute over them waits for the same result.
        self._filling: dict[int, list[_Filling]] = {}
        # Finished requests with saves keep their blocks until the workers say the saves are
        # done (Settings.holds_blocks).
        self.holds = holds
        # Requests that had saves handed out (kept apart from _tracked, which reset_cache
        # clears: a worker holds those requests' blocks all the same).
        self._saving: set[str] = set()
        self.epoch = WeightEpoch()
        # (epoch, namespace) of requests with no LoRA, salt or multimodal input.
        self._plain = ("", self.epoch.namespace(Namespace(tenant=settings.tenant)))
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[_PlannedLoad] = []
        # Lookups, each with its own deadline, several at once, behind the breaker.
        self._lookups = LookupThreads(LOOKUP_THREADS, "kvtier-lookup")
        self.breaker = LookupBreaker(settings.lookup_pause_s)

    def _namespace(self, request: Request) -> Namespace | None:
        if not (
            getattr(request, "lora_request", None)
            or getattr(request, "cache_salt", None)
            or getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            # Most requests: the instance's own namespace, made once per weight epoch.
            epoch, ns = self._plain
            if epoch != self.epoch.value:
                ns = self.epoch.namespace(Namespace(tenant=self.settings.tenant))
                self._plain = (self.epoch.value, ns)
            return ns
        ns = namespace_of(request, self.settings.tenant)
        return None if ns is None else self.epoch.namespace(ns)

    def _track(self, request: Request, ns: Namespace) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None or t.namespace != ns:
            t = self._tracked[request.request_id] = _Tracked(request, ns)
        return t

    # ------------------------------------------------------------------ lookups

    def _lookup(self, t: _Tracked, start: int, limit: int) -> tuple[Lookup, int]:
        """On a background thread: the agent's answer for pages ``start..limit`` of the
        request, and the page its returned keys begin at. Sends the prompt from its first
        token the first time, and afterwards only the pages asked about."""
        if self.breaker.is_open(time.monotonic()):
            # Queued behind lookups that timed out: nothing cached, without asking.
            return Lookup(0, 0, 0, None, b""), start
        bs = self.block_size
        tokens = t.request.all_token_ids
        known = len(t.keys)
        deadline = self.settings.lookup_timeout_s
        try:
            if 0 < start <= known:
                parent = t.keys[start - 1]
                prompt = After(parent, TokenWindow(tokens, start * bs, limit * bs))
                found = self.agent.lookup_pages(
                    prompt, t.namespace, start, want_keys=known < limit, timeout=deadline
                )
                return found, start
            found = self.agent.lookup_pages(
                TokenWindow(tokens, 0, limit * bs),
                t.namespace,
                start,
                want_keys=known < limit,
                timeout=deadline,
            )
            return found, 0
        except KvtierError as e:
            self.counts.lookup_failures += 1
            self.breaker.failed(e)
            raise

    def _start_lookup(self, t: _Tracked, start: int, limit: int, now: float) -> None:
        self.counts.lookups += 1
        p = t.lookup = PendingLookup(start, limit, now)
        self._lookups.submit(p, self._lookup, t, start, limit)

    @staticmethod
    def _harvest(t: _Tracked) -> None:
        """Takes the keys a finished lookup brought back (a failed one brought none)."""
        p = t.lookup
        if p is None or not p.done or p.result is None:
            return
        found, first = p.result
        t.keys.merge(first, found.packed_keys)

    def _answer(
        self, t: _Tracked, p: PendingLookup[tuple[Lookup, int]], start: int, limit: int
    ) -> _Hit:
        """What the finished lookup ``p`` found after ``start`` (nothing when it failed),
        and whether to load it asynchronously (per ``load_async``)."""
        if p.error is not None or p.result is None:
            # Every failure is a miss, whatever raised it (an error that is not the agent's
            # says so louder): never an exception on vLLM's scheduler thread. Said once per
            # lookup, though vLLM may ask again for a while.
            if not p.reported:
                p.reported = True
                if isinstance(p.error, KvtierError):
                    logger.warning("kvtier: lookup failed, computing instead: %s", p.error)
                else:
                    logger.error("kvtier: lookup failed, computing instead: %r", p.error)
            return _Hit(start)
        found, first = p.result
        t.keys.merge(first, found.packed_keys)
        n = max(0, min(p.start + found.l2_pages + found.l3_pages, limit) - start)
        mode = self.load_mode
        from_l3 = start + n > p.start + found.l2_pages
        load_async = n > 0 and (mode == "always" or (mode == "auto" and from_l3))
        l2 = max(0, min(p.start + found.l2_pages, start + n) - start)
        return _Hit(start, n, found.save_pages, load_async, l2)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.consumes:
            return 0, False
        bs = self.block_size
        t = self._tracked.get(request.request_id)
        p = t.lookup if t is not None else None
        now = time.monotonic()
        start, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if (
            t is not None
            and p is not None
            and not p.done
            and p.start == start < limit <= p.limit
            and now - p.started <= self.settings.lookup_timeout_s
            and not self.breaker.is_open(now)
        ):
            # Still waiting for the lookup this request asked for: vLLM asks every step, so
            # this answer costs as little as it can (the namespace is the one the lookup
            # was sent under: reset_cache forgets every tracked request). Not for a request
            # with nothing to look up (start == limit): it is answered 0 at once, its keys
            # fetched meanwhile.
            if t.hit is None or t.hit.start != p.start or t.hit.pages:
                t.hit = _Hit(p.start)
            self.counts.deferred_lookups += 1
            return None, False
        ns = self._namespace(request)
        if ns is None:
            return 0, False
        t = self._track(request, ns)
        # vLLM computes at least the last token itself (it needs its logits): limit, above.
        # Pages from one a load of this request failed at are computed, never loaded again.
        if t.load_failed_at is not None:
            limit = min(limit, max(start, t.load_failed_at))
        t.hit = _Hit(start)
        p = t.lookup
        if self.breaker.is_open(now):
            # The agent stopped answering a moment ago: nothing cached, without asking.
            self.counts.lookups_skipped += 1
            return 0, False
        if start >= limit:
            # Nothing to look up; fetch the keys for later saves if they are missing.
            self._harvest(t)
            if len(t.keys) < limit and (p is None or p.done):
                self._start_lookup(t, limit, limit, now)
            return 0, False
        fresh = (
            p is not None
            and p.start <= start
            and p.limit >= limit
            and (not p.done or not p.done_at or now - p.done_at < LOOKUP_MAX_AGE_S)
        )
        if not fresh:
            self._start_lookup(t, start, limit, now)
            self.counts.deferred_lookups += 1
            return None, False
        assert p is not None
        if not p.done:
            if now - p.started > self.settings.lookup_timeout_s:
                # Queued and sent for longer than a lookup may take: nothing cached.
                p.dropped = True
                t.lookup = None
                self.counts.lookups_skipped += 1
                return 0, False
            self.counts.deferred_lookups += 1
            return None, False
        if not p.done_at:
            p.done_at = now
        t.hit = self._answer(t, p, start, limit)
        return t.hit.pages * bs, t.hit.load_async

    # ------------------------------------------------------------------ allocation and steps

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks | None, num_external_tokens: int
    ) -> None:
        ns = self._namespace(request)
        if ns is None:
            return
        t = self._track(request, ns)
        t.running = True
        self._harvest(t)
        hit, t.hit = t.hit, None
        # vLLM's blocks for the request, as its block objects: their ids are read only where
        # needed (reading all of them took 0.5 ms at 128k tokens). The step's output names
        # the ids of every scheduled request's blocks (build_connector_meta).
        kv: Sequence[KVCacheBlock] = (
            blocks.blocks[0] if blocks is not None and blocks.blocks else ()
        )
        if kv and self._filling:
            # Only vLLM's own hits (the blocks before the answer's start) can be shared
            # with another request; the rest were free until now.
            self._wait_for_shared_loads(
                t, request.request_id, kv if hit is None else kv[: hit.start]
            )
        bs = self.block_size
        if hit is None:
            hit = _Hit(request.num_computed_tokens // bs)
        else:
            t.selected = hit.selected
        start, n = hit.start, hit.pages
        # Pages vLLM had and pages about to be loaded need no save.
        t.saved = max(t.saved, start + num_external_tokens // bs)
        host = min(hit.l2_pages * bs, num_external_tokens)
        t.sources = {
            k: v
            for k, v in (
                (CacheHitSource.HOST, host),
                (CacheHitSource.DISK, num_external_tokens - host),
            )
            if v > 0
        }
        if n <= 0 or num_external_tokens <= 0:
            return
        self.counts.external_tokens += num_external_tokens
        n = min(n, num_external_tokens // bs, len(kv) - start)
        if n <= 0:
            return
        tokens = request.all_token_ids
        t.keys.extend_to(start, tokens, ns, bs)
        job = Job(
            request.request_id,
            TokenWindow(tokens, start * bs, (start + n) * bs),
            ns,
            start,
            [],
            parent=t.keys.parent_of(start),
            load_async=hit.load_async,
        )
        if hit.load_async:
            # The request is not in this step's output (it waits for the load): its ids
            # now, for the load and for finding it by a block that failed.
            self.counts.async_loads += 1
            t.blocks = [b.block_id for b in kv]
            job.blocks = t.blocks[start : start + n]
        else:
            # vLLM computes over this load in the step that runs it: what it computes is
            # saved only once every rank's result is back (update_connector_output).
            t.unconfirmed = self._step
            self._unconfirmed.setdefault(self._step, []).append(request.request_id)
            self._filling.setdefault(self._step, []).append(_Filling(kv[start : start + n]))
        self._loads.append(_PlannedLoad(t, job, kv, n))

    def _wait_for_shared_loads(
        self, t: _Tracked, req_id: str, shared: Sequence[KVCacheBlock]
    ) -> None:
        """A request allocated over blocks a load before the forward pass fills (vLLM's
        prefix cache shares them at allocation, before the load's result is back) computes
        over them: its pages wait for that result too. Only a request allocated since such
        a load can hold its blocks, so this runs at allocation, never per step."""
        if not shared:
            return
        ids = [b.block_id for b in shared]
        step = max(
            (
                s
                for s, fills in self._filling.items()
                if any(not f.ids().isdisjoint(ids) for f in fills)
            ),
            default=-1,
        )
        if step >= 0 and (t.unconfirmed is None or t.unconfirmed < step):
            t.unconfirmed = step
            self._unconfirmed.setdefault(step, []).append(req_id)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The request's external hits by tier: L2 as ``host``, L3 as ``disk``."""
        t = self._tracked.get(request.request_id)
        if t is None or sum(t.sources.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return dict(t.sources)

    def _count_jobs(self, jobs: list[Job]) -> None:
        for j in jobs:
            self.counts.job_pages += len(j.blocks)
            self.counts.job_tokens += len(j.tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        if not (
            scheduler_output.num_scheduled_tokens
            or self._loads
            or scheduler_output.preempted_req_ids
        ):
            # Nothing ran and nothing to load (every request waits, for its pages, say):
            # vLLM's engine loop steps like this as fast as it can while loads are out.
            self._step += 1
            return KvtierMetadata(step=self._step - 1)
        tables: dict[str, list[int]] = {}
        for req_id, new_blocks, full_table in yield_req_data(scheduler_output):
            t = self._tracked.get(req_id)
            if t is None or new_blocks is None:
                continue
            if full_table:
                t.blocks = tables[req_id] = list(new_blocks[0])
            else:
                t.blocks.extend(new_blocks[0])
        meta = KvtierMetadata(
            loads=[p.finish(tables) for p in self._loads],
            preempted=sorted(scheduler_output.preempted_req_ids or ()),
            step=self._step,
        )
        self._step += 1
        self._loads = []
        self._count_jobs(meta.loads)
        if not self.produces:
            return meta
        self._plan_saves(scheduler_output, meta)
        self._count_jobs(meta.saves)
        return meta

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: KvtierMetadata) -> None:
        """A save for every block that becomes full in this step."""
        bs = self.block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None or not t.running or t.unconfirmed is not None:
                continue
            tokens = t.request.all_token_ids
            # Pages full after this step, whose tokens are all known now.
            done = min(t.request.num_computed_tokens + scheduled, len(tokens)) // bs
            done = min(done, len(t.blocks))
            if not self.settings.save_decode:
                # Pages of the prompt only: a page past it holds generated tokens.
                done = min(done, t.request.num_prompt_tokens // bs)
            if done <= t.saved:
                continue
            # The parent of the first new page; the keys of the new ones follow from it
            # (hashed here only past what the lookup returned).
            self._harvest(t)
            t.keys.extend_to(t.saved, tokens, t.namespace, bs)
            meta.saves.append(
                Job(
                    req_id,
                    TokenWindow(tokens, t.saved * bs, done * bs),
                    t.namespace,
                    t.saved,
                    t.blocks[t.saved : done],
                    t.selected,
                    t.keys.parent_of(t.saved),
                )
            )
            t.saved = done
            self._saving.add(req_id)

    def update_connector_output(
        self, output: KVConnectorOutput, cache: KVCacheManager | None = None
    ) -> None:
        """A step's output, every rank's joined. Blocks that failed to load on any rank
        (vLLM has rolled their requests back by now): dropped from vLLM's prefix cache
        (``cache``; under ``recompute`` vLLM keeps them, and a request that is not running
        any more, or a later one, would hit their stale bytes), and each request holding one
        saves again from the first, since vLLM recomputes from there and what was computed
        over it is wrong. Steps whose loads every rank ran (StepsDone): what was computed
        over them may be saved from the next step on."""
        invalid = output.invalid_block_ids
        if invalid:
            if cache is not None:
                cache.evict_blocks(set(invalid))
            bs = self.block_size
            for t in self._tracked.values():
                bad = next((i for i, b in enumerate(t.blocks) if b in invalid), None)
                if bad is None:
                    continue
                back = min(t.saved, bad, t.request.num_computed_tokens // bs)
                self.counts.rewound_pages += t.saved - back
                t.saved = back
                if t.load_failed_at is None or bad < t.load_failed_at:
                    t.load_failed_at = bad
        done = output.kv_connector_worker_meta
        if isinstance(done, StepsDone):
            for step in done.steps:
                self._filling.pop(step, None)
                for req_id in self._unconfirmed.pop(step, ()):
                    t = self._tracked.get(req_id)
                    if t is not None and t.unconfirmed == step:
                        t.unconfirmed = None

    def reset_cache(self) -> None:
        """Moves this instance to a new weight epoch, so nothing stored before is served to
        it again, and forgets the loads and saves planned under the old one (their KV may be
        the old weights'). Pages in the shared tiers stay for other instances."""
        self.epoch.bump()
        self._tracked.clear()
        self._unconfirmed.clear()
        self._filling.clear()
        self._loads = []
        logger.info("kvtier: connector cache reset: a new weight epoch; earlier pages unused")

    def request_finished(self, request: Request) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its saves
        done: only where saves may read the blocks after the step (DMA, and staging on CPU:
        Settings.holds_blocks) and the request had some."""
        t = self._tracked.pop(request.request_id, None)
        if t is not None and t.unconfirmed is not None:
            # Its last pages were computed over a load whose result is not back: not saved.
            done = min(request.num_computed_tokens // self.block_size, len(t.blocks))
            if not self.settings.save_decode:
                done = min(done, request.num_prompt_tokens // self.block_size)
            self.counts.save_unconfirmed_pages += max(0, done - t.saved)
        saving = request.request_id in self._saving
        self._saving.discard(request.request_id)
        return self.holds and saving

    def shutdown(self) -> None:
        self._lookups.shutdown()
