"""kvtier's vLLM connector at engine speed: vLLM's real Scheduler and the connector's
scheduler and worker sides in this process (as vLLM runs them, minus the forward pass),
against a kvtierd and a kvtier-agent, each figure beside a baseline measured in the same run.

    KVTIERD_BIN=.../release/kvtierd KVTIERAGENT_BIN=.../release/kvtier-agent \\
        python benches/vllm_bench.py [--quick] [--json]

Rows (``kvtier-bench --only vllm`` runs this and holds them to their goals):

- **scheduler-thread time per waiting request, p99**, prompts of 1k, 16k and 128k tokens,
  cold (nothing stored), cached (every page in L2), and cached under async scheduling
  (vLLM's default on a GPU: every load asynchronous): vLLM's real Scheduler runs each
  request to its end, and every call it makes on the connector is timed, a call about one
  request charged to it, a call about the whole step split among the requests the
  scheduler holds (``--explain`` prints the time per connector method); baseline: one
  blocking lookup of the same prompt, what the scheduler paid before. Beside each, the
  same figure against vLLM's own scheduler work for the same requests (``schedule`` and
  ``update_from_output`` less the connector's calls in them, charged the same way): what
  the connector adds to what the scheduler pays anyway.
- **Save of the one page a decode step completes**, at 1k, 16k and 128k tokens: the Save
  named after its parent page's key, carrying 16 tokens; baseline: the same Save carrying
  the whole prefix.
- **SaveBatch of a decode step**, 32 requests completing one page each (16k-token
  prompts): the time per page of the one SaveBatch the connector sends per step; baseline:
  one Save per page.
- **worker-side connector time per decode step**, 32 and 256 running requests of
  staggered ages (each step completes some pages): the time the step spends in the
  connector's hooks (``handle_preemptions``, ``start_load_kv``, ``wait_for_save``; the
  forward, a 2 ms wait with the GIL released, left out) against a memcpy of the step's new
  KV bytes from memory as cold as the KV cache's, into a ring the size of the staging pool.
- **save thread's gather per page**, the same runs: the copy of a page from vLLM's blocks
  into the staging pool, which runs after the step on the save thread, against the same
  memcpy per page.
- **decode-step time while one request's pages come from an L3 delayed 2 s**: the median
  step time of 32 running requests while a 33rd loads from a slow L3, against the median
  step time of the same requests with no load waiting, over 4 interleaved rounds (quiet
  windows before and after every loading one).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BLOCK = 16
LAYERS, HEADS, HEAD = 8, 8, 128  # 64 KiB per block per layer: an 8B model's shape
STEP = 32  # requests completing a page in one decode step, for the SaveBatch row
ROWS: list[dict] = []


def row(figure: str, value: float, unit: str, baseline: str, base: float, ratio: float | None):
    ROWS.append(
        dict(
            figure=figure,
            value=value,
            unit=unit,
            baseline=baseline,
            baseline_value=base,
            ratio=ratio,
        )
    )
    r = "-" if ratio is None else f"{ratio:.3f}"
    print(f"{figure:<56} {value:>9.3f} {unit:<4} baseline {base:>9.3f}  ratio {r}", file=sys.stderr)


_MODELS: dict[tuple[int, tuple[int, int, int]], str] = {}


def model_dir(max_len: int, shape: tuple[int, int, int]) -> str:
    """A checkpoint's config.json for this shape (one per shape: the same checkpoint for
    every engine of a part, as instances of one deployment share it)."""
    if (max_len, shape) in _MODELS:
        return _MODELS[(max_len, shape)]
    layers, heads, head = shape
    d = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-model-"))
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": heads * 2 * head,
                "num_attention_heads": heads * 2,
                "num_key_value_heads": heads,
                "num_hidden_layers": layers,
                "intermediate_size": 256,
                "vocab_size": 32000,
                "max_position_embeddings": max_len,
                "torch_dtype": "bfloat16",
            }
        )
    )
    _MODELS[(max_len, shape)] = str(d)
    return str(d)


def flag(agent: str, **extra) -> str:
    return json.dumps(
        {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"agent": agent, **extra},
        }
    )


class Engine:
    """vLLM's Scheduler and one worker's connector over CPU KV tensors; ``step()`` is one
    engine step with the model runner's connector hooks around an empty forward pass."""

    def __init__(
        self,
        agent: str,
        max_len: int,
        seqs: int,
        blocks: int,
        forward_s: float = 0.0,
        shape: tuple[int, int, int] = (LAYERS, HEADS, HEAD),
        async_scheduling: bool = False,
        **extra,
    ):
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.integrations.vllm.connector import KvtierConnector

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--kv-transfer-config", flag(agent, **extra)])
        assert args is not None
        ktc = EngineArgs.from_cli_args(args).kv_transfer_config
        vc = VllmConfig(
            model_config=ModelConfig(
                model=model_dir(max_len, shape),
                skip_tokenizer_init=True,
                max_model_len=max_len,
                dtype="bfloat16",
            ),
            parallel_config=ParallelConfig(),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=8192,
                max_num_seqs=seqs,
                max_model_len=max_len,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=ktc,
            device_config=DeviceConfig("cpu"),
        )
        vc.cache_config.num_gpu_blocks = blocks
        # vLLM's CPU platform turns async scheduling off; on a GPU it is vLLM's default, and
        # the connector then announces every load asynchronous (Settings.load_mode).
        vc.scheduler_config.async_scheduling = async_scheduling
        layers, heads, head = shape
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
        )
        kcc = KVCacheConfig(
            num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
        )
        self.vc = vc
        worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
        assert isinstance(worker, KvtierConnector), type(worker)
        self.worker = worker
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        # Written once, as the forward passes would have: copies read mapped memory.
        self.kv = {
            n: torch.full((blocks, heads, BLOCK, 2 * head), float(i), dtype=torch.bfloat16)
            for i, n in enumerate(names)
        }
        self.worker.register_kv_caches(self.kv)
        kind = AsyncScheduler if async_scheduling else Scheduler
        self.sched = kind(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK)
        assert self.sched.connector is not None, "vLLM's scheduler made no connector"
        self.sched_connector = self.sched.connector
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.page_bytes = layers * heads * BLOCK * 2 * head * 2
        # As vLLM's EngineCore does once its scheduler is built: the startup heap is frozen,
        # so the collector's passes during serving skip it.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        # The forward pass's stand-in: a wait with the GIL released, as a forward's kernels
        # (or a CPU forward's torch ops) release it; 0: an empty forward.
        self.forward_s = forward_s
        self.hook_s = 0.0
        self.saved_pages = 0
        self.n = 0
        # Set by scheduler_lookups: charged vLLM's own scheduler time per step.
        self.clock: ConnectorClock | None = None

    def add(self, tokens: list[int], max_tokens: int) -> str:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        rid = f"r{self.n}"
        self.sched.add_request(
            Request(
                rid,
                tokens,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                None,
                block_hasher=self.hasher,
            )
        )
        return rid

    def step(self) -> None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        clock = self.clock
        c0 = clock.total if clock is not None else 0.0
        s0 = time.perf_counter()
        so = self.sched.schedule()
        own = time.perf_counter() - s0
        meta = so.kv_connector_metadata
        self.saved_pages = sum(len(j.blocks) for j in getattr(meta, "saves", []))
        t = time.perf_counter()
        forward = 0.0
        # As vLLM's model runner does before the forward.
        if meta is not None:
            self.worker.handle_preemptions(meta)
        with (
            set_forward_context(None, self.vc),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out,
        ):
            if self.forward_s:
                f = time.perf_counter()
                time.sleep(self.forward_s)
                forward = time.perf_counter() - f
        self.hook_s = time.perf_counter() - t - forward
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.sched.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens
            sampled.append([random.randrange(32000)] if done else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        s0 = time.perf_counter()
        self.sched.update_from_output(so, runner_output)
        own += time.perf_counter() - s0
        if clock is not None:
            # vLLM's own part: the two calls less the connector calls made inside them.
            clock.scheduler_step(own - (clock.total - c0))

    def drain(self) -> bool:
        """Waits for the worker's saves in flight; True when none is left."""
        side = self.worker.worker
        assert side is not None, "a worker connector without its worker side"
        return side.drain()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched_connector.shutdown()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def _runqueue_s() -> float:
    """Seconds this thread has waited for a core (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class ConnectorClock:
    """The time vLLM's scheduler thread spends in the connector, per request: every call
    the scheduler makes on it is timed. A call about one request (``get_num_new_matched_
    tokens``, ``update_state_after_alloc``, ``request_finished`` ...) is charged to that
    request; a call about the whole step (``build_connector_meta``,
    ``update_connector_output`` ...) is split evenly among the requests the scheduler
    holds at that moment."""

    def __init__(self, conn, held, detail: bool = False) -> None:
        import inspect

        # Also the CPU time and the time waiting for a core (--explain).
        self.detail = detail
        # Per request followed, per method (--explain: where the slowest request's went).
        self.spent_by: dict[str, dict[str, float]] = {}
        # Per method, over every request followed: where the time goes (--explain).
        self.by_method: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        # The scheduler thread's own CPU time in them, and its time waiting for a core (the
        # rest: waiting for the GIL, or a lock).
        self.cpu: dict[str, float] = {}
        self.queued: dict[str, float] = {}
        # Of the time in them, the garbage collector's passes (on the scheduler thread, set
        # off by whichever allocation crossed its threshold: vLLM's or kvtier's).
        self.collecting: dict[str, float] = {}
        self._gc_s = 0.0
        self._gc_start = 0.0
        if detail:
            gc.callbacks.append(self._gc)
        # Per request followed: its wall (what the rows report), CPU, queued and collector
        # time.
        self.how: dict[str, list[float]] = {}
        # Every connector call's time, summed; and per request followed, vLLM's own
        # scheduler time (schedule and update_from_output less the connector's calls in
        # them), split among the requests held as the step-wide calls are.
        self.total = 0.0
        self.own: dict[str, float] = {}
        self._held = held
        for name in dir(type(conn)):
            if name.startswith("_") or name == "shutdown":
                continue
            static = inspect.getattr_static(type(conn), name)
            if not inspect.isfunction(static):
                continue
            setattr(conn, name, self._timed(name, getattr(conn, name)))

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def close(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _timed(self, name: str, fn):
        detail = self.detail

        def timed(*args, **kwargs):
            # Outside the timed span: the CPU clock and schedstat are system calls.
            q, c = (_runqueue_s(), time.thread_time()) if detail else (0.0, 0.0)
            g = self._gc_s
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t
                cpu = time.thread_time() - c if detail else 0.0
                queued = _runqueue_s() - q if detail else 0.0
                collecting = self._gc_s - g
                self.total += spent
                self.by_method[name] = self.by_method.get(name, 0.0) + spent
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu
                self.queued[name] = self.queued.get(name, 0.0) + queued
                self.collecting[name] = self.collecting.get(name, 0.0) + collecting
                self.calls[name] = self.calls.get(name, 0) + 1
                self._charge(name, args, (spent, cpu, queued, collecting))

        return timed

    def _charge(self, name: str, args, spent: tuple[float, float, float, float]) -> None:
        rid = getattr(args[0], "request_id", None) if args else None
        ids = [rid] if rid is not None else list(self._held())
        for r in ids:
            if r in self.how:
                mine = self.spent_by[r]
                mine[name] = mine.get(name, 0.0) + spent[0] / len(ids)
                how = self.how[r]
                for i in range(4):
                    how[i] += spent[i] / len(ids)

    def scheduler_step(self, seconds: float) -> None:
        ids = [r for r in self._held() if r in self.own]
        for r in ids:
            self.own[r] += seconds / len(ids)

    def follow(self, rid: str) -> None:
        self.own[rid] = 0.0
        self.spent_by[rid] = {}
        self.how[rid] = [0.0, 0.0, 0.0, 0.0]


def scheduler_lookups(agent, quick: bool, explain: bool = False) -> None:
    """Scheduler-thread time per waiting request, cold and cached, against one blocking
    lookup: vLLM's real Scheduler runs the requests to their end (a 2 ms forward), and
    every connector call it makes is timed (:class:`ConnectorClock`). Cold: nothing is
    stored; every request looks up, computes and saves. Cached: the same prompts on a
    fresh engine (vLLM's own prefix cache empty), every page in L2; then once more under
    async scheduling (vLLM's default on a GPU), where every load is asynchronous."""
    from kvtier.agent import AgentClient
    from kvtier.integrations.vllm.connector import KvtierConnector

    lengths = ((1024, 32), (16384, 16), (131072, 8 if not quick else 3))
    # One layer of one KV head: the scheduler side's work does not depend on the page's
    # bytes, and 8 prompts of 128k tokens fit in memory twice (vLLM's blocks and L2).
    shape = (1, 1, HEAD)
    blocks = max(n * (length // BLOCK + 2) for length, n in lengths)
    client = AgentClient(agent.socket)
    # The last round as on a GPU, where async scheduling is vLLM's default: every load is
    # then asynchronous (the request waits out of the batch for its pages).
    for phase, overlapped in (("cold", False), ("cached", False), ("cached, async sched", True)):
        e = Engine(
            agent.socket,
            131072 + 1024,
            32,
            blocks,
            forward_s=0.002,
            shape=shape,
            async_scheduling=overlapped,
        )
        clock = ConnectorClock(e.sched_connector, lambda e=e: e.sched.requests.keys(), explain)
        e.clock = clock
        for length, count in lengths:
            prompts = [tokens(length, length + i) for i in range(count)]
            blocking = []
            for p in prompts[:3]:
                t = time.perf_counter()
                client.lookup_pages(p[: (length - 1) // BLOCK * BLOCK])
                blocking.append(time.perf_counter() - t)
            ids = [e.add(p, 1) for p in prompts]
            for rid in ids:
                clock.follow(rid)
            while any(rid in e.sched.requests for rid in ids):
                e.step()
            while not e.drain():
                time.sleep(0.01)
            if explain:
                ms = {
                    k: f"{v * 1e3:.2f} ms ({clock.cpu[k] * 1e3:.2f} cpu, "
                    f"{clock.queued[k] * 1e3:.2f} queued, "
                    f"{clock.collecting[k] * 1e3:.2f} collecting) / {clock.calls[k]}"
                    for k, v in clock.by_method.items()
                }
                print(phase, length, "per connector method (time / calls):", ms, file=sys.stderr)
                for d in (
                    clock.by_method,
                    clock.cpu,
                    clock.queued,
                    clock.collecting,
                    clock.calls,
                ):
                    d.clear()
            times = sorted(clock.how[rid][0] for rid in ids)
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3
            if explain:
                worst = max(ids, key=lambda r: clock.how[r][0])
                ms = {k: round(v * 1e3, 3) for k, v in clock.spent_by[worst].items() if v}
                wall, cpu, queued, collecting = (round(x * 1e3, 3) for x in clock.how[worst])
                print(
                    phase,
                    length,
                    f"the slowest request: {wall} ms ({cpu} cpu, {queued} waiting for a core, "
                    f"{collecting} in the garbage collector); by method:",
                    ms,
                    file=sys.stderr,
                )
            base = statistics.median(blocking) * 1e3
            row(
                f"scheduler time per waiting request p99, {length // 1024}k tokens, {phase}",
                p99,
                "ms",
                "blocking lookup p50",
                base,
                base / p99 if p99 else None,
            )
            # The same requests' share of vLLM's own scheduler work (its schedule and
            # update_from_output, the connector's calls taken out): what the connector adds
            # to a step the scheduler pays anyway.
            own = sorted(clock.own[rid] for rid in ids)
            own99 = own[min(len(own) - 1, int(0.99 * len(own)))] * 1e3
            row(
                f"connector time per waiting request vs vLLM's own, {length // 1024}k tokens, "
                f"{phase}",
                p99,
                "ms",
                "vLLM's own scheduler time p99",
                own99,
                own99 / p99 if p99 else None,
            )
        done = e.worker.counts
        sched_side = e.sched_connector
        assert isinstance(sched_side, KvtierConnector), type(sched_side)
        announced = sched_side.counts.async_loads
        clock.close()
        e.close()
        del e
        # Each round must have done what it is named for, or its rows measure something else.
        if phase == "cold" and (done.loaded_pages or not done.saved_pages):
            raise SystemExit(f"the cold round loaded pages or saved none: {done}")
        if phase != "cold" and not done.loaded_pages:
            raise SystemExit(f"the {phase} round loaded nothing: {done}")
        if overlapped and not announced:
            raise SystemExit("under async scheduling no load was announced asynchronous")
    client.close()


def save_one_page(agent, quick: bool) -> None:
    """The Save of one decode page after its parent's key, against the whole prefix."""
    from kvtier.agent import After, AgentClient, SaveItem
    from kvtier.integrations.vllm.staging import Staging
    from kvtier.keys import Namespace, page_keys
    from kvtier.layout import LayoutSpec, State

    client = AgentClient(agent.socket, timeout=30)
    staging = Staging(LAYERS, 2 * STEP, HEADS * BLOCK * 2 * HEAD * 2)
    desc = LayoutSpec(
        model_id="bench-save",
        model_version="",
        dtype="uint8",
        num_layers=LAYERS,
        page_size=BLOCK,
        shape=State(HEADS * 2 * HEAD * 2),
        tp_rank=0,
        tp_size=1,
    ).descriptor()
    client.register_pool(desc, 2 * STEP * BLOCK, cpu_fd=staging.fd, engine_cache=True)
    ns = Namespace(tenant="bench")
    rounds = 5 if quick else 15
    for length in (1024, 16384, 131072):
        prefix = tokens(length - BLOCK, 7 + length)
        parent = page_keys(prefix, BLOCK, ns)[-1]
        last = length // BLOCK - 1
        sub, base = [], []
        for r in range(rounds):
            fresh = tokens(BLOCK, 1000 * length + 2 * r)
            t = time.perf_counter()
            s = client.save_pages(After(parent, fresh), ns, last, [0])
            sub.append(time.perf_counter() - t)
            assert s.stored == 1, s
            whole = prefix + tokens(BLOCK, 1000 * length + 2 * r + 1)
            t = time.perf_counter()
            s = client.save_pages(whole, ns, last, [1])
            base.append(time.perf_counter() - t)
            assert s.stored == 1, s
        m, b = statistics.median(sub) * 1e3, statistics.median(base) * 1e3
        row(
            f"Save of a decode step's one page, {length // 1024}k tokens",
            m,
            "ms",
            "Save with the whole prefix",
            b,
            b / m,
        )
    # A decode step of STEP requests completes one page each: one SaveBatch for all of
    # them (what the connector sends), against one Save per page.
    length = 16384
    prefixes = [tokens(length - BLOCK, 31 + i) for i in range(STEP)]
    parents = [page_keys(p, BLOCK, ns)[-1] for p in prefixes]
    last = length // BLOCK - 1
    batched, single = [], []
    for r in range(rounds):
        items = [
            SaveItem(After(parents[i], tokens(BLOCK, 7_000_000 + 97 * r + i)), ns, last, [i])
            for i in range(STEP)
        ]
        t = time.perf_counter()
        saved = client.save_batch(items)
        batched.append((time.perf_counter() - t) / STEP)
        assert sum(s.stored for s in saved) == STEP, saved
        t = time.perf_counter()
        for i in range(STEP):
            fresh = tokens(BLOCK, 9_000_000 + 97 * r + i)
            s = client.save_pages(After(parents[i], fresh), ns, last, [STEP + i])
            assert s.stored == 1, s
        single.append((time.perf_counter() - t) / STEP)
    m, b = statistics.median(batched) * 1e3, statistics.median(single) * 1e3
    row(
        f"SaveBatch of a decode step, {STEP} requests x 1 page, per page",
        m,
        "ms",
        "one Save per page",
        b,
        b / m,
    )
    client.close()
    staging.close()


def decode_steps(agent, running: int, quick: bool) -> None:
    """Connector time per decode step against a memcpy of the step's new KV bytes, and the
    save thread's gather of those pages against the same memcpy."""
    from kvtier.integrations.vllm.staging import Staging

    # A forward pass stands in as a 2 ms wait with the GIL released (a GPU's decode step of
    # an 8B model takes 10-20 ms); the hooks' time is measured without it. The save
    # thread's gathers run beside it, as they would beside a forward.
    e = Engine(agent.socket, 4096, running, running * 24 + 64, forward_s=0.002)
    # Prompts of 64 to 79 tokens: the requests complete their pages on different steps, as
    # a batch of requests of different ages does, rather than all on every 16th step.
    for i in range(running):
        e.add(tokens(64 + i % 16, 50_000 + i), 400)
    deadline = time.monotonic() + 60
    while len(e.sched.running) < running:
        assert time.monotonic() < deadline, f"only {len(e.sched.running)} requests running"
        e.step()
    for _ in range(16):
        e.step()
    gather = {"s": 0.0, "pages": 0}
    real = Staging.from_blocks

    def timed(self, views, blocks, slots):
        t = time.perf_counter()
        try:
            return real(self, views, blocks, slots)
        finally:
            gather["s"] += time.perf_counter() - t
            gather["pages"] += len(slots)

    Staging.from_blocks = timed  # the save thread's gathers, timed
    # The baseline reads as the gather does: the step's blocks sit in a KV cache far larger
    # than the CPU's caches, written long before, and land in a staging ring of 256 pages.
    # So the memcpy walks a 1 GiB source and a destination of the staging's size (both
    # touched first), never copying the same cache-warm bytes twice in a row.
    src = np.full((1 << 30) // e.page_bytes * e.page_bytes, 7, dtype=np.uint8)
    dst = np.full(256 * e.page_bytes, 1, dtype=np.uint8)
    at_src = at_dst = 0
    hooks = mem = 0.0
    pages = 0
    steps = 60 if quick else 200
    try:
        for _ in range(steps):
            e.step()
            # The baseline's copy runs alone, not beside the save thread's (a real step is
            # long enough for the saves to end within it).
            assert e.drain(), "the saves did not drain"
            nbytes = min(e.saved_pages * e.page_bytes, len(dst))
            if at_src + nbytes > len(src):
                at_src = 0
            if at_dst + nbytes > len(dst):
                at_dst = 0
            t = time.perf_counter()
            np.copyto(dst[at_dst : at_dst + nbytes], src[at_src : at_src + nbytes])
            mem += time.perf_counter() - t
            at_src += nbytes
            at_dst += nbytes
            hooks += e.hook_s
            pages += e.saved_pages
        assert e.drain(), "the saves did not drain"
    finally:
        Staging.from_blocks = real
    e.close()
    assert len(e.sched.running) == running, "a request ended or was preempted mid-run"
    row(
        f"connector time per decode step, {running} running ({pages} pages)",
        hooks * 1e3 / steps,
        "ms",
        "memcpy of the new KV",
        mem * 1e3 / steps,
        mem / hooks if hooks else None,
    )
    # Each step's pages are gathered after it, on the save thread: per page, against the
    # memcpy's per page.
    per_page = mem / pages if pages else 0.0
    row(
        f"save thread's gather per page, {running} running ({gather['pages']} pages)",
        gather["s"] * 1e6 / max(gather["pages"], 1),
        "us",
        "memcpy per page",
        per_page * 1e6,
        per_page * gather["pages"] / gather["s"] if gather["s"] else None,
    )


def slow_l3(work: Path, quick: bool) -> None:
    """Step time of 32 decoding requests while a 33rd loads from an L3 delayed 2 s.

    32 requests decode at all times (each replaced when it ends, so the KV cache never fills
    and nothing is preempted). Measured in interleaved windows: quiet, then a request whose
    pages are only in the slow L3 arrives and the 32 step while it waits, then it finishes
    untimed; 4 rounds, and a last quiet window. The figure is the median of every step taken
    while a load waited, the baseline the median of every quiet step, so a neighbour's load
    on the host, and the run's own drift (L2 filling, its flushes to L3), weigh on both
    sides alike instead of on one 2 s window of each.
    """
    from kvtier.testing import Agent, Kvtierd, l3_objects

    rounds, window = (2, 1.0) if quick else (4, 1.5)
    l3 = work / "l3"
    d1 = Kvtierd(work / "d1", "l2.pool_pages=2048", f"l3.file.path={l3}")
    a1 = Agent(work, "l3a", d1.socket)
    e = Engine(a1.socket, 4096, 40, 2048)
    # One prompt per round: a prompt loaded once is in L2 for the next round.
    cached = [tokens(1024, 4242 + r) for r in range(rounds)]
    for prompt in cached:
        e.add(prompt, 1)
    while e.sched.has_requests():
        e.step()
    e.drain()
    e.close()
    deadline = time.time() + 60
    while len(l3_objects(l3)) < 60 * rounds:
        assert time.time() < deadline, "the pages never reached L3"
        time.sleep(0.1)
    time.sleep(1)
    a1.stop()
    d1.stop()
    d2 = Kvtierd(work / "d2", "l2.pool_pages=2048", f"l3.file.path={l3}", "l3.fault_get_delay=2s")
    a2 = Agent(work, "l3b", d2.socket)
    try:
        e = Engine(a2.socket, 4096, 40, 2048)
        # 32 decoding requests at all times, of staggered ages, each replaced when it ends:
        # a KV cache that never fills, so no step preempts one (their 512 tokens each fit).
        runners: set[str] = set()
        seed = 70_000

        def top_up() -> None:
            nonlocal seed
            runners.intersection_update(e.sched.requests)
            while len(runners) < 32:
                seed += 1
                runners.add(e.add(tokens(64, seed), 512))

        for _ in range(32):
            seed += 1
            runners.add(e.add(tokens(64, seed), 512))
            for _ in range(16):
                e.step()
        for _ in range(100):
            e.step()
            top_up()

        def timed_steps(seconds: float) -> list[float]:
            out = []
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                t = time.perf_counter()
                e.step()
                out.append(time.perf_counter() - t)
                top_up()
            return out

        # Quiet windows bracket every loading one (Q L Q L ... Q), so a drift over the run
        # (L2 filling up, its flushes to L3 growing) weighs on both sides alike.
        before: list[float] = []
        during: list[float] = []
        for prompt in cached:
            before += timed_steps(window)
            rid = e.add(prompt + tokens(32, 1), 4)
            # The window ends before the 2 s delay does: every step in it has the load
            # waiting.
            during += timed_steps(window)
            # Untimed: it loads, prefills its 32 new tokens and finishes before the next
            # quiet window.
            deadline = time.time() + 30
            while rid in e.sched.requests:
                assert time.time() < deadline, (
                    f"the slow load never finished: {e.sched.requests[rid].status!r}, "
                    f"{e.sched.requests[rid].num_computed_tokens} computed"
                )
                e.step()
                top_up()
            for _ in range(10):
                e.step()
                top_up()
        before += timed_steps(window)
        b, d = statistics.median(before) * 1e3, statistics.median(during) * 1e3
        e.drain()
        e.close()
        row(
            "decode step while one request loads from a 2 s L3",
            d,
            "ms",
            "decode step before it",
            b,
            b / d,
        )
    finally:
        a2.stop()
        d2.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    ap.add_argument(
        "--explain",
        action="store_true",
        help="lookups: print the scheduler thread's time per connector method",
    )
    parts_names = ["lookups", "save", "decode32", "decode256", "slow_l3"]
    ap.add_argument(
        "--only",
        action="append",
        choices=parts_names,
        help="run only these parts (repeatable; default: all)",
    )
    a = ap.parse_args()
    only = set(a.only or parts_names)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's PyPI wheel is built for CUDA: on a machine without one, its CPU platform.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvtier.testing import Agent, Kvtierd

    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-"))
    # Room for the lookups part's cached round: 8 prompts of 128k tokens in 8 KiB pages.
    d = Kvtierd(work / "d", "l2.pool_pages=90000", "l3.backend=none")
    try:
        # An agent serves one engine's pool: one agent per part, on one kvtierd.
        parts = [
            ("lookups", lambda ag: scheduler_lookups(ag, a.quick, a.explain)),
            ("save", lambda ag: save_one_page(ag, a.quick)),
            ("decode32", lambda ag: decode_steps(ag, 32, a.quick)),
            ("decode256", lambda ag: decode_steps(ag, 256, a.quick)),
        ]
        for name, run in parts:
            if name not in only:
                continue
            agent = Agent(work, name, d.socket)
            try:
                run(agent)
            finally:
                agent.stop()
    finally:
        d.stop()
    try:
        if "slow_l3" in only:
            slow_l3(work / "slow", a.quick)
    finally:
        # Its kvtierds' L3 files: gigabytes per run.
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(ROWS))


if __name__ == "__main__":
    main()
