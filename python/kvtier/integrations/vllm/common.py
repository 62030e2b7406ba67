"""What both sides of the vLLM connector share: its settings, where a worker sits, the
jobs the scheduler side hands the workers each step (:class:`KvtierMetadata`), and the
counters both keep."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.agent import After
from kvtier.host import POLICIES, KvtierError
from kvtier.keys import KEY_BYTES, Namespace, extend_keys
from kvtier.settings import fill

logger = logging.getLogger("kvtier.vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig


#: Keys the connector took once, and why they are gone.
_GONE = {
    "staging_dir": "the staging pool is a memfd the worker hands the agent as a descriptor, "
    "in no directory",
    "staging_mode": "the staging pool is a memfd the worker hands the agent as a descriptor, "
    "with no file mode (an agent under another uid receives it all the same)",
}


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
    # Deadline of a lookup, in seconds: past it the request is computed, and for
    # lookup_pause_s after a lookup timed out or found the agent gone, every request is
    # answered "nothing cached" at once instead of waiting for the agent.
    lookup_timeout_s: float = 2.0
    lookup_pause_s: float = 5.0
    # Save the pages completed while decoding too (their tokens include generated ones);
    # false: only pages of the prompt, for deployments whose next turns rarely resend an
    # answer.
    save_decode: bool = True
    # When vLLM is told a load is asynchronous (the request waits, out of the batch, until
    # its pages are in; other requests keep stepping): "auto" when some of its pages come
    # from L3, "always", or "never" (every load before the step that needs it).
    load_async: str = "auto"
    # How blocks move between vLLM's KV cache and L2: "dma" (the agent copies them itself,
    # from the GPU allocation the worker exports by CUDA IPC handle: no staging pool, no
    # copy on the worker's side), "staging" (the worker copies them through a shared-memory
    # pool the agent maps), or "auto": dma where the KV cache is on a GPU and the agent's
    # import passes its check, else staging (a fallback is logged and counted).
    transfer: str = "auto"

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> Settings:
        where = "kv_connector_extra_config"
        for gone in _GONE.keys() & (extra or {}).keys():
            raise ValueError(f"kvtier: {where}.{gone}: no longer taken: {_GONE[gone]}; remove it")
        s = Settings()
        fill(s, dict(extra or {}), where)
        if s.load_policy and s.load_policy not in POLICIES:
            raise ValueError(
                f"kvtier: {where}.load_policy: {s.load_policy!r} is not one of "
                f"{', '.join(POLICIES)} (or empty for kvtierd's)"
            )
        if s.load_async not in ("auto", "always", "never"):
            raise ValueError(
                f"kvtier: {where}.load_async: {s.load_async!r} is not one of auto, always, never"
            )
        if s.transfer not in ("auto", "dma", "staging"):
            raise ValueError(
                f"kvtier: {where}.transfer: {s.transfer!r} is not one of auto, dma, staging"
            )
        if s.staging_pages < 1:
            raise ValueError(f"kvtier: {where}.staging_pages: must be at least 1")
        if s.load_timeout_ms < 0:
            raise ValueError(f"kvtier: {where}.load_timeout_ms: must not be negative")
        if s.timeout_s <= 0:
            raise ValueError(f"kvtier: {where}.timeout_s: must be above 0")
        if s.lookup_timeout_s <= 0:
            raise ValueError(f"kvtier: {where}.lookup_timeout_s: must be above 0")
        if s.lookup_pause_s < 0:
            raise ValueError(f"kvtier: {where}.lookup_pause_s: must not be negative")
        return s

    def holds_blocks(self, device_type: str) -> bool:
        """Whether a worker may still be reading a finished request's blocks after the step:
        DMA saves on a GPU (the agent copies after the step) and staging saves on CPU (the
        save thread gathers after the step). Then the scheduler keeps them until every worker
        reports the request's saves done (``get_finished``). A GPU's staging copies are
        ordered on its stream within the step, and hold nothing back."""
        if device_type == "cpu":
            return True
        return self.transfer != "staging" and device_type == "cuda"

    def may_dma(self, device_type: str) -> bool:
        """Whether the workers may move blocks by DMA (``choose_transfer``): ``dma``, or
        ``auto`` on a GPU. The agent then writes a load straight into vLLM's blocks."""
        return self.transfer == "dma" or (self.transfer == "auto" and device_type == "cuda")

    def load_mode(self, overlapped_steps: bool, dma: bool = False) -> str:
        """``load_async`` as the scheduler applies it. Where vLLM runs a step before the
        previous one's output is back (``overlapped_steps``: async scheduling, its default on
        a GPU, or pipeline parallelism, whose batch queue holds a step per stage) every load
        is asynchronous: a load before the forward pass that fails rolls its request back
        after vLLM already ran the next step over the failed blocks, and vLLM 0.33 keeps that
        step's output (the request's next token, sampled over the stale blocks; found by the
        engine fuzzer, seeds 2, 3, 19 and 35, and by review under PP 2). An asynchronous load
        fails before the request computes anything.

        Where the agent may write loads straight into vLLM's blocks (``dma``), every load is
        asynchronous too: vLLM keeps a request's blocks until its asynchronous load is
        reported finished, and the worker reports a load that failed only once no part of
        its copies can still write (transfer.py, ``DmaTransfer.load``). A synchronous load
        has no such hold: blocks reported failed may go to another request while a part of
        the agent's copy is still on its way."""
        why = ""
        if dma:
            why = "the agent writes loads into vLLM's blocks itself (DMA)"
        elif overlapped_steps:
            why = (
                "vLLM runs a step before the last one's output is back (async scheduling or "
                "pipeline parallelism)"
            )
        if why and self.load_async != "always":
            if self.load_async == "never":
                logger.warning("kvtier: load_async = never, but %s: loads are asynchronous", why)
            return "always"
        return self.load_async

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


def choose_transfer(
    transfer: str,
    device: str,
    on_gpu: bool,
    register_dma: Callable[[], None],
    in_shared_memory: bool = False,
) -> tuple[bool, str | None]:
    """Whether a worker's blocks move by DMA (``register_dma`` succeeded: the agent opened
    the KV cache and its check passed), and, when ``auto`` fell back to staging on a GPU,
    why. ``dma`` that cannot be had is an error naming the setting; a registration refused
    because another client owns the agent's pool is raised as it is, whatever the setting.

    On CPU, ``dma`` is had only where the KV cache lies in shared memory
    (``in_shared_memory``): the agent then reads and writes the blocks in place. vLLM's own
    CPU worker allocates private memory, so this is the engine fuzzer's stand-in for a GPU's
    DMA (the same worker code over CPU memory); ``auto`` on CPU is staging."""
    where = "kv_connector_extra_config.transfer"
    if transfer == "staging" or (transfer == "auto" and not on_gpu):
        return False, None
    if not on_gpu and not in_shared_memory:
        raise ValueError(
            f"kvtier: {where}: dma needs the KV cache on a CUDA GPU (or in CPU shared memory "
            f"the agent can map); this worker's is private memory on {device}"
        )
    try:
        register_dma()
        return True, None
    except KvtierError as e:
        if e.pool_taken or transfer == "dma":
            raise
        return False, f"the agent refused the KV cache: {e}"
    except (RuntimeError, ValueError) as e:
        if transfer == "dma":
            raise ValueError(f"kvtier: {where}: dma: cannot export the KV cache: {e}") from e
        return False, f"cannot export the KV cache: {e}"


def check_kv_cache_groups(kv_cache_config: Any) -> None:
    """Refuses, naming the model's spec, a KV cache the connector cannot keep right: more
    than one group (hybrid attention), or one whose blocks vLLM frees or overwrites while
    the request runs (sliding window, chunked local attention, Mamba state, sinks: saves
    that read blocks after the step would copy whatever their next owner wrote). Only full
    attention, MHA or MLA, keeps a running request's blocks as they were computed."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise ValueError(
            f"kvtier: the model has {len(groups)} KV cache groups ({kinds}: hybrid attention); "
            "the connector supports models with one group of full attention"
        )
    for g in groups:
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        chunk = getattr(spec, "attention_chunk_size", None)
        # Non-causal (prefix-LM) layers: a page's KV depends on tokens after it.
        later = getattr(spec, "non_causal", False)
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec) or window or chunk or later:
            what = type(spec).__name__
            if window:
                what += f" (sliding_window={window})"
            if chunk:
                what += f" (attention_chunk_size={chunk})"
            if later:
                what += " (non_causal)"
            raise ValueError(
                f"kvtier: the model's KV cache is {what}; the connector supports full "
                "attention only (FullAttentionSpec or MLAAttentionSpec): vLLM frees or "
                "reuses the blocks of other kinds while a request runs, so a save could "
                "read another request's KV"
            )


def overlapped_steps(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's engine core runs a step before the previous one's output is back: its
    executor keeps two batches in flight under async scheduling and one per pipeline stage
    under pipeline parallelism (``max_concurrent_batches``, ``step_with_batch_queue``)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    return bool(vllm_config.scheduler_config.async_scheduling) or pp > 1


def check_parallel(vllm_config: VllmConfig) -> None:
    """Refuses context parallelism, naming the setting: vLLM's scheduler block then covers
    ``block_size x cp`` tokens spread over the ranks, which neither the page keys nor the
    identity's shard (vLLM 0.33 has no call that gives a worker its DCP rank) follow yet;
    served, one shard's pages would load into another's blocks."""
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise ValueError(
                f"kvtier: parallel_config.{name} is {size}; the connector does not support "
                "context parallelism yet (set it to 1, or run without the connector)"
            )


@dataclass(frozen=True)
class Ranks:
    """Where a worker sits: its TP, PP and DP ranks, and its GPU on the node."""

    tp: int = 0
    pp: int = 0
    dp: int = 0
    local: int = 0

    @staticmethod
    def of_worker(vllm_config: VllmConfig) -> Ranks:
        pc = vllm_config.parallel_config
        tp = parallel_rank(lambda ps: ps.get_tensor_model_parallel_rank(), 0)
        pp = parallel_rank(lambda ps: ps.get_pp_group().rank_in_group, 0)
        # Without vLLM's world group (one node assumed): vLLM's rank order, PP-major.
        local = parallel_rank(
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
    def of_scheduler(vllm_config: VllmConfig) -> Ranks:
        """The ranks of the first worker (TP 0, PP 0) of the scheduler's DP rank."""
        pc = vllm_config.parallel_config
        dp_local = getattr(pc, "data_parallel_rank_local", None) or 0
        return Ranks(dp=getattr(pc, "data_parallel_rank", 0) or 0, local=dp_local * pc.world_size)


@dataclass
class Job:
    """Pages ``start..start+len(blocks)`` of a prompt, held in (or going to) ``blocks``:
    their ``tokens`` only, after ``parent``, the key of page ``start - 1`` (None when
    ``start`` is 0), so a job costs its own pages, never the whole prefix."""

    req_id: str
    tokens: Sequence[int]
    namespace: Namespace
    start: int
    blocks: list[int]
    # Saves: the write policy's selection as the scheduler's lookup answered it (pages
    # before it are saved), the same for every TP rank; None: each agent's policy decides.
    selected: int | None = None
    parent: bytes | None = None
    # Loads: vLLM was told the load is asynchronous (the request waits for get_finished).
    load_async: bool = False

    def prompt(self) -> Sequence[int] | After:
        """The tokens as the agent's calls take them."""
        return self.tokens if self.parent is None else After(self.parent, self.tokens)

    def head(self, n: int, bs: int) -> Job:
        """The job's first ``n`` pages (of ``bs`` tokens; the whole job when it has no
        more)."""
        if n >= len(self.blocks):
            return self
        return dataclasses.replace(self, tokens=self.tokens[: n * bs], blocks=self.blocks[:n])

    def after(self, n: int, bs: int, parent: bytes = b"") -> Job | None:
        """The job's pages past its first ``n`` (None when none is left), which follow
        ``parent``, the key of page ``start + n - 1``: as an agent's Load named it, else
        (not a key) hashed here."""
        if n >= len(self.blocks):
            return None
        if len(parent) != KEY_BYTES:
            parent = extend_keys(self.parent, self.tokens[: n * bs], bs, self.namespace)[-1]
        return dataclasses.replace(
            self,
            tokens=self.tokens[n * bs :],
            start=self.start + n,
            blocks=self.blocks[n:],
            parent=parent,
        )

    def split(self, n: int, bs: int) -> tuple[Job, Job | None]:
        """The job's first ``n`` pages, and the rest (None when nothing is left), which
        follows the key of page ``start + n - 1`` (hashed here)."""
        return self.head(n, bs), self.after(n, bs)


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's work for the workers: loads before the forward pass, saves after it."""

    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    # Requests preempted this step: their blocks are reused once the step starts, so saves
    # still reading them finish first (``handle_preemptions``).
    preempted: list[str] = field(default_factory=list)
    # The step's number, counted by the scheduler side: workers name it back
    # (:class:`StepsDone`) once they ran its loads.
    step: int = 0

    def has_sync_loads(self) -> bool:
        return any(not j.load_async for j in self.loads)


@dataclass
class StepsDone(KVConnectorWorkerMetadata):
    """What workers tell the scheduler side with a step's output: the steps whose loads
    before the forward pass they ran. vLLM joins every rank's before the scheduler sees it,
    together with every rank's failed blocks, so the scheduler side then knows whether the
    pages computed over those loads are right on every rank."""

    steps: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StepsDone):
            return self
        return StepsDone(self.steps | other.steps)


@dataclass
class Counts:
    """What this connector did, for logs and tests (the agent's metrics have the rest).
    Scheduler side: tokens vLLM took as external hits. Worker side: pages loaded, pages a
    load missed (vLLM recomputed them), pages saved or already in L2, pages not saved."""

    external_tokens: int = 0
    # Scheduler side: answers of "ask again" while a lookup ran on a background thread;
    # lookups sent; pages and tokens of the jobs handed to the workers (a job carries only
    # its own pages' tokens: tokens = pages x block size).
    deferred_lookups: int = 0
    lookups: int = 0
    job_pages: int = 0
    job_tokens: int = 0
    # Scheduler side: loads vLLM was told are asynchronous.
    async_loads: int = 0
    # Scheduler side: lookups that failed (the request computes), and requests answered
    # "nothing cached" without asking while lookups pause after an agent stopped answering.
    lookup_failures: int = 0
    lookups_skipped: int = 0
    # Scheduler side: pages rewound to be saved again after a load failed on some rank
    # (vLLM recomputes them; what was computed over the failed load is never saved).
    rewound_pages: int = 0
    # Scheduler side: pages computed over a load whose result on every rank had not come
    # back when the request finished; not saved (they may stand on a failed load).
    save_unconfirmed_pages: int = 0
    loaded_pages: int = 0
    load_error_pages: int = 0
    saved_pages: int = 0
    save_failed_pages: int = 0
    # Pages not saved because every staging page was taken by saves still in flight.
    save_dropped_pages: int = 0
    # Pages not saved because their request was preempted while the save thread had not
    # gathered them yet and the step could wait no longer (timeout_s): vLLM reuses the
    # blocks, so the copy is given up rather than read another request's KV.
    save_preempted_pages: int = 0
    loaded_bytes: int = 0
    saved_bytes: int = 0
    # Staging pools given up after a call that may have left a copy running in them.
    retired_staging: int = 0
    # Workers whose KV is on a GPU that fell back from the agent's DMA to the staging pool.
    dma_fallbacks: int = 0
    # Failed DMA loads whose blocks were held past one Cancel: the agent was slow to stop
    # copying into them (stopped, or too busy).
    load_settle_waits: int = 0


def parallel_rank(get: Any, default: int = 0) -> int:
    """A rank from vLLM's parallel state (``get(parallel_state)``), or ``default`` where
    that state is not set up (a process without vLLM's distributed groups)."""
    try:
        from vllm.distributed import parallel_state

        return int(get(parallel_state))
    except (AssertionError, ImportError, RuntimeError, AttributeError, TypeError):
        return default
