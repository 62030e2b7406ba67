"""One vLLM worker's engine loop on CPU, with vLLM's own classes, for the connector tests.

Run as a script (one process per worker, as vLLM runs them)::

    python vllm_engine.py --kv-transfer-config JSON --prompts FILE --out FILE [--kill PID@STEP]
        [--served-name NAME] [--variant N] [--kv-dtype DTYPE] [--dp-rank N] [--pp-stage N]
        [--reset-then FILE] [--fail-copy load|save] [--time-out load|save] [--tp N] [--pp N]
        [--mla] [--blocks N] [--lora NAME=PATH] [--aborts P] [--stall-load PID]
        [--late-save SECS]

The options set up the deployments users run: a served alias (``--served-name``) over one
of several checkpoints (``--variant``: another config, so other weights), an fp8 KV cache
format, a DP rank (its own GPU, so its own agent), a pipeline stage (this worker holds the
layers of stage N), a weight update (``--reset-then``: after the prompts, the "weights"
change, vLLM's ``reset_prefix_cache(reset_connector=True)`` runs, then the prompts in FILE),
a staging copy that raises (``--fail-copy``), an agent call that outlives its deadline
(``--time-out``: the first Load or Save is sent for real, and the connector is told at
once that its deadline passed, while the agent may still be copying), tensor parallelism
(``--tp N``: N workers in this process, one per TP rank, each with its own connector, KV
and agent, fed the same scheduler output; their load errors are merged as vLLM's output
aggregator merges them), pipeline parallelism (``--pp N``: N stages of TP ranks, each
worker with its stage's layers, its own connector and agent; the stand-in mixes every
worker's KV as it mixes the TP ranks'), LoRA adapters (``--lora NAME=PATH``: a prompt's
``"lora"`` names one; the stand-in's KV depends on the adapter file's bytes, read as the
model loads them), and an MLA model (``--mla``: a DeepSeek-V2-shaped config, whose latent
is the same on every rank).

It builds the ``VllmConfig`` from the same ``--kv-transfer-config`` flag ``vllm serve`` takes,
parsed by vLLM's own argument parser; creates the connector through vLLM's factory (which
loads ``kvtier.vllm`` by its module path) on both sides; and drives vLLM's ``Scheduler``
(its KV cache manager, block pool and prefix cache), real ``Request`` objects and the model
runner's connector hooks (``KVConnectorModelRunnerMixin``), step by step until every request
is done. As vLLM's engine core does, it keeps steps in flight: it schedules and runs step N+1
before it hands step N's output to the scheduler, two deep under ``--async-scheduling``
(vLLM's ``AsyncScheduler``, its default on a GPU; the model runner's tokens for positions the
scheduler holds as placeholders are the ones it sampled) and one per stage under ``--pp``.

The one part that is not vLLM's is the forward pass: vLLM's CPU attention kernels
(``vllm._C``) are not in the PyPI wheel, which is built for CUDA. In its place (``Model``)
each step writes every scheduled token's KV into the blocks vLLM's slot mapping names, where
the model would write it, as a function of the token, its position and a digest of the KV
bytes of every earlier position **as they are in the blocks at that moment**, on every TP
rank (the all-reduce mixes them). It reads its context as attention does: a block computed
over a stale or foreign block comes out wrong, and so does everything after it, on every
rank. After each step, every block vLLM counts as computed is compared with an oracle that
recomputes the request from scratch in blocks of its own. The sampled token is a function
of the last token's KV as stored, so a wrong block also changes the outputs; a token vLLM
keeps from a step that read a wrong block counts as wrong, even if vLLM rolled its request
back.

Faults for the fuzzer (fuzz.py): ``--short-loads P`` (a Load asks the agent for only some of
its pages, as when pages left L2 between lookup and load), ``--drop-saves RANK:P`` (a TP
rank's saves are lost, so the ranks' agents disagree), ``--aborts P`` (the client aborts a
request, whatever it is doing), ``--stall-load PID`` (kvtierd stopped through the second
Load's deadline while the agent waits for it; the request is then aborted),
``--late-save SECS`` (the saves reading a preempted request's blocks go out past the
connector's wait for them), ``--seed`` (their generator), ``--max-batched-tokens`` (chunked
prefill), ``--spec`` (a KV cache spec other than full attention).

Where vLLM frees a running request's blocks (a preemption, an abort), another request takes
every free block at once (``Reuse``): it writes its own KV into them, holds them a second,
and checks they still hold it when they come back; a block written meanwhile is reported
(``overwritten_blocks``). With ``transfer = dma`` in the flag the KV cache lies in shared
memory, and the agent reads and writes the blocks in place (the CPU stand-in for DMA).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from engine_faults import Faults, time_out_first

BLOCK = 16
HEADS, HEAD = 2, 16
# MLA: the latent (kv_lora_rank 32) and the rope part (16) of one token.
LORA, ROPE = 32, 16
LAYERS = 2
NUM_BLOCKS = 203  # not 2, not 16: the block dimension is found by its size
# The first pipeline stage this process runs (--pp-stage; --pp N runs N from it).
FIRST_STAGE = [0]
# Set by --mla.
MLA = [False]
# Set by --spec: the KV cache spec's kind where it is not full attention.
SPEC = ["full"]
# Set by --lora NAME=PATH: the LoRA adapters a prompt's "lora" may name.
LORAS: dict[str, str] = {}


def model_dir(variant: int = 0) -> str:
    """A model directory with only a tiny model's config.json (Llama, or DeepSeek-V2 for
    MLA): no weights are loaded. The same path in every worker of a variant; another variant
    is another checkpoint (its config differs)."""
    kind = "mla" if MLA[0] else "llama"
    d = Path(tempfile.gettempdir()) / f"kvtier-vllm-tiny-{kind}-{variant}"
    d.mkdir(exist_ok=True)
    common = {
        "num_hidden_layers": LAYERS * 2,
        "intermediate_size": 128 + 64 * variant,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    if MLA[0]:
        cfg = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": LORA,
            "q_lora_rank": None,
            "qk_rope_head_dim": ROPE,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "moe_intermediate_size": 64,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": LAYERS * 2,
        }
    else:
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HEADS * 2 * HEAD,
            "num_attention_heads": HEADS * 2,
            "num_key_value_heads": HEADS,
        }
    (d / "config.json").write_text(json.dumps({**cfg, **common}))
    return str(d)


def config(
    kv_transfer_json: str,
    served_name: str | None = None,
    variant: int = 0,
    kv_dtype: str = "auto",
    dp_rank: int = 0,
    tp: int = 1,
    pp: int = 1,
    max_batched_tokens: int = 256,
    async_scheduling: bool = False,
):
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The flag exactly as `vllm serve` parses it.
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", kv_transfer_json])
    ktc = EngineArgs.from_cli_args(args).kv_transfer_config
    from vllm.config import ModelConfig, ParallelConfig

    mc = ModelConfig(
        model=model_dir(variant),
        served_model_name=served_name,
        skip_tokenizer_init=True,
        max_model_len=2048,
        dtype="bfloat16",
    )
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    # The DP rank as vLLM's engine core sets it for a rank on this node.
    pc.data_parallel_rank = pc.data_parallel_rank_local = dp_rank
    vc = VllmConfig(
        model_config=mc,
        parallel_config=pc,
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, cache_dtype=kv_dtype
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_batched_tokens,
            max_num_seqs=16,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    # vLLM's CPU platform turns async scheduling off ("not required on CPU"); on a GPU it is
    # vLLM's default. The scheduler does not depend on the platform: as on a GPU.
    vc.scheduler_config.async_scheduling = async_scheduling
    return vc


def stage_layers(stage: int = 0) -> list[str]:
    """The attention layers of pipeline stage ``stage`` of this process."""
    first = (FIRST_STAGE[0] + stage) * LAYERS
    return [f"model.layers.{first + i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(names: list[str] | None = None):
    """The KV cache config vLLM hands the connector: one group over ``names`` (default:
    stage 0's layers)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    if SPEC[0] != "full":
        from vllm.v1 import kv_cache_interface as kci

        kind, extra = {
            "sliding_window": (kci.SlidingWindowSpec, {"sliding_window": 4 * BLOCK}),
            "chunked_local": (kci.ChunkedLocalAttentionSpec, {"attention_chunk_size": 4 * BLOCK}),
        }[SPEC[0]]
        spec = kind(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, **extra
        )
    elif MLA[0]:
        spec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.bfloat16
        )
    else:
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
        )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names or stage_layers(), spec)],
    )


class Kv:
    """One worker's KV cache (a TP rank of a pipeline stage): vLLM's CPU attention layout
    per layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (MLA:
    ``[num_blocks, block_size, kv_lora_rank + rope_dim]``), with numpy views of the same
    memory for reading it fast."""

    def __init__(
        self, rank: int = 0, num_blocks: int | None = None, stage: int = 0, shared: bool = False
    ):
        self.tp_rank, self.stage = rank, stage
        # What makes this worker's KV its own: its stage's layers, and its TP rank's heads
        # (MLA: the latent is the same on every TP rank).
        self.rank = stage * 8 + (0 if MLA[0] else rank)
        n = NUM_BLOCKS if num_blocks is None else num_blocks
        shape = (n, BLOCK, LORA + ROPE) if MLA[0] else (n, HEADS, BLOCK, 2 * HEAD)
        self.names = stage_layers(stage)
        self.layers = {name: torch.zeros(*shape, dtype=torch.bfloat16) for name in self.names}
        if shared:
            # In shared memory (before any view of it is taken: sharing moves the storage):
            # the worker's DMA path registers it and the agent reads and writes the blocks
            # in place, the CPU stand-in for a GPU's DMA.
            for t in self.layers.values():
                t.share_memory_()
        # int16 bit patterns: any bytes are a valid bf16 tensor to store and compare.
        self.raw = [t.view(torch.int16).numpy() for t in self.layers.values()]

    def token(self, layer: int, block: int, off: int):
        """One token's KV in one layer, where vLLM's slot mapping puts it (a view)."""
        a = self.raw[layer]
        return a[block, off, :] if MLA[0] else a[block, :, off, :]

    def token_bytes(self, block: int, off: int) -> bytes:
        return b"".join(self.token(li, block, off).tobytes() for li in range(len(self.raw)))

    def block_bytes(self, block: int) -> bytes:
        return b"".join(a[block].tobytes() for a in self.raw)


def _expand(seed: bytes, n: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(seed + i.to_bytes(2, "little")).digest()
        i += 1
    return bytes(out[:n])


class Model:
    """The stand-in forward pass. It reads its context as attention does: a position's KV
    (on every TP rank, in every layer) is a function of its token, its position and a
    digest of the KV bytes of every earlier position **as they are in the blocks at that
    moment**, on every TP rank (the all-reduce after attention mixes the ranks). A block
    computed over a stale or foreign block is then wrong, and so is everything after it.

    The digest is chunk-independent (a position's depends only on the bytes before it):
    the full blocks' bytes chained block by block, then the tokens of the position's own
    block before it. ``weights`` seeds it: other weights, other KV for the same tokens."""

    def __init__(self, weights: bytes = b"weights"):
        self.weights = weights
        # The oracle: each request recomputed from scratch in blocks of its own, by the
        # same forward pass (req_id -> (ranks' KV, tokens computed)).
        self._oracle: dict[str, tuple[list[Kv], int]] = {}
        # (rank, block) pairs compared with the oracle.
        self.checked = 0

    def update_weights(self, weights: bytes) -> None:
        """Other weights: the same tokens' KV changes."""
        self.weights = weights
        self._oracle.clear()

    def forward(
        self,
        kvs: list[Kv],
        tokens: list[int],
        blocks: list[int],
        start: int,
        end: int,
        adapter: bytes = b"",
    ):
        """Computes positions ``start..end`` of a request into ``blocks`` on every rank,
        reading positions ``0..start`` from the blocks as they are now. ``adapter``: the
        request's LoRA adapter's weights (empty: none), which change every token's KV."""
        if end <= start:
            return
        per_token = len(kvs[0].token_bytes(blocks[0], 0))
        # Each rank's chain over the full blocks before start, and a hasher over the
        # tokens of start's block before it.
        first = start // BLOCK
        chains, partial = [], []
        for kv in kvs:
            c = self.weights + adapter
            for b in range(first):
                c = hashlib.sha256(c + kv.block_bytes(blocks[b])).digest()
            h = hashlib.sha256(c)
            for off in range(start % BLOCK):
                h.update(kv.token_bytes(blocks[first], off))
            chains.append(c)
            partial.append(h)
        for pos in range(start, end):
            b, off = pos // BLOCK, pos % BLOCK
            if off == 0 and pos > start:
                # A block just filled: the chain takes its bytes as they are in memory.
                for r, kv in enumerate(kvs):
                    chains[r] = hashlib.sha256(chains[r] + kv.block_bytes(blocks[b - 1])).digest()
                    partial[r] = hashlib.sha256(chains[r])
            mixed = hashlib.sha256(b"".join(h.digest() for h in partial))
            mixed.update(tokens[pos].to_bytes(4, "little") + pos.to_bytes(4, "little"))
            seed = mixed.digest()
            for kv, h in zip(kvs, partial, strict=True):
                raw = _expand(seed + bytes([kv.rank]), per_token)
                step = per_token // len(kv.raw)
                for li in range(len(kv.raw)):
                    dst = kv.token(li, blocks[b], off)
                    part = raw[li * step : (li + 1) * step]
                    dst[...] = np.frombuffer(part, dtype=np.int16).reshape(dst.shape)
                h.update(kv.token_bytes(blocks[b], off))

    def expected(
        self, req_id: str, like: list[Kv], tokens: list[int], upto: int, adapter: bytes = b""
    ) -> list[Kv]:
        """The oracle's KV of the request's first ``upto`` tokens on workers ``like``,
        recomputed from scratch (block i of the request in block i of its own store)."""
        kvs, done = self._oracle.get(req_id, (None, 0))
        need = (upto + BLOCK - 1) // BLOCK
        if kvs is None or kvs[0].raw[0].shape[0] < need:
            n = max(need, 1) * 2
            kvs = [Kv(rank=k.tp_rank, num_blocks=n, stage=k.stage) for k in like]
            done = 0
        ids = list(range(kvs[0].raw[0].shape[0]))
        self.forward(kvs, tokens, ids, done, upto, adapter)
        self._oracle[req_id] = (kvs, max(done, upto))
        return kvs

    def wrong_blocks(
        self,
        kvs: list[Kv],
        req_id: str,
        tokens: list[int],
        blocks: list[int],
        upto: int,
        adapter: bytes = b"",
    ) -> set[tuple[int, int]]:
        """(rank, block) among the first ``upto`` tokens' blocks that differ from
        recomputing them."""
        want = self.expected(req_id, kvs, tokens, upto, adapter)
        wrong = set()
        for r, (kv, ok) in enumerate(zip(kvs, want, strict=True)):
            self.checked += (upto + BLOCK - 1) // BLOCK
            for i in range((upto + BLOCK - 1) // BLOCK):
                n = min(BLOCK, upto - i * BLOCK)
                for li in range(len(kv.raw)):
                    got = kv.raw[li][blocks[i]]
                    exp = ok.raw[li][i]
                    if MLA[0]:
                        same = np.array_equal(got[:n], exp[:n])
                    else:
                        same = np.array_equal(got[:, :n], exp[:, :n])
                    if not same:
                        wrong.add((r, blocks[i]))
                        break
        return wrong

    @staticmethod
    def sample(kv: Kv, blocks: list[int], n: int) -> int:
        """The next token: a function of the last token's KV as it is in its block."""
        pos = n - 1
        digest = hashlib.sha256(kv.token_bytes(blocks[pos // BLOCK], pos % BLOCK)).digest()
        return int.from_bytes(digest[:2], "little") % 1000


class VllmStats:
    """What vLLM's stat loggers receive from the scheduler: the connector's transfer figures
    through vLLM's own KVConnectorProm (its Prometheus metrics) and KVConnectorLogging (its
    log line), and the external prefix-cache hits by tier."""

    def __init__(self, vc):
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorLogging,
            KVConnectorProm,
        )

        self.prom = KVConnectorProm(vc, ["model_name", "engine"], {0: ["tiny", "0"]})
        self.log = KVConnectorLogging(vc.kv_transfer_config)
        self.hits: dict[str, int] = {}
        self.preemptions = 0
        # Finished requests whose blocks vLLM kept for the workers' saves, then freed once
        # every worker reported them done (finished_sending).
        self.held_released = 0
        # Seconds from the phase's start to each request's first step.
        self.admitted: dict[str, float] = {}
        # Whether --kill / --stop fired (the run reached its step).
        self.killed = False
        # Steps scheduled while an earlier one's output was still to be taken (async
        # scheduling).
        self.overlapped_steps = 0
        # Steps whose sampled token vLLM kept although the step read wrong blocks.
        self.kept_over_wrong = 0

    def report(self) -> dict:
        from prometheus_client import REGISTRY

        prom = {}
        for metric in REGISTRY.collect():
            if metric.name.startswith("vllm:kvtier_"):
                for sample in metric.samples:
                    if sample.name.endswith(("_total", "_count")):
                        prom[sample.name] = prom.get(sample.name, 0) + sample.value
        acc = self.log.transfer_stats_accumulator
        return {
            "prom": prom,
            "logged": acc.reduce() if acc is not None and not acc.is_empty() else {},
            "hits_by_source": self.hits,
            "preemptions": self.preemptions,
            "held_released": self.held_released,
            "admitted_s": self.admitted,
            "killed": self.killed,
            "overlapped_steps": self.overlapped_steps,
            "kept_over_wrong": self.kept_over_wrong,
        }


def run(
    vc,
    prompts: list[dict],
    kill: tuple[int, int, int] | None,
    then: list[dict] | None = None,
    fail_copy: str | None = None,
    time_out: str | None = None,
    slow_save: float = 0.0,
    faults: Faults | None = None,
    fail_new_staging: int = 0,
) -> dict:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    tp = vc.parallel_config.tensor_parallel_size
    pp = vc.parallel_config.pipeline_parallel_size
    # The scheduler's KV cache config: every stage's layers in one group, as vLLM's engine
    # core merges its workers' configs.
    kcc = kv_cache_config([n for st in range(pp) for n in stage_layers(st)])
    if fail_new_staging:
        # After the first staging pool, the next ones cannot be created (no room left in
        # the staging directory, say): a replacement fails and must be tried again later.
        from kvtier.integrations.vllm import staged
        from kvtier.integrations.vllm.staged import StagedTransfer

        # The engine's steps here take milliseconds, not vLLM's tens: try again sooner.
        staged.STAGING_RETRY_S = 0.05
        new_staging = StagedTransfer._new_staging
        made = {"n": 0}

        def no_room(self):
            made["n"] += 1
            if 1 < made["n"] <= 1 + fail_new_staging:
                raise OSError("injected: no room for a new staging pool")
            return new_staging(self)

        StagedTransfer._new_staging = no_room
    if fail_copy:
        # The first staging copy raises, as a device copy that fails would.
        from kvtier.integrations.vllm.staging import Staging

        method = {"load": "to_blocks", "save": "from_blocks"}[fail_copy]
        real = getattr(Staging, method)
        calls = {"n": 0}

        def failing(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected staging copy failure")
            return real(self, *a, **k)

        setattr(Staging, method, failing)
    if time_out:
        time_out_first(time_out)
    if slow_save:
        # Every SaveBatch goes out late, as to an L2 that answers slowly: the save thread
        # runs behind the engine, and each step's copies start that much later.
        from kvtier.agent import AgentClient

        save_batch = AgentClient.save_batch

        def late(self, *a, **k):
            time.sleep(slow_save)
            return save_batch(self, *a, **k)

        AgentClient.save_batch = late
    faults = faults or Faults(block=BLOCK)
    faults.install()
    # Each worker's connector (every TP rank of every pipeline stage, in vLLM's rank order,
    # PP-major), made by vLLM's factory from the flag with its stage's KV cache config, and
    # registered as the model runner registers it, while vLLM's parallel state says which
    # ranks it is.
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    ranks = []
    # kvtier's transfer = "dma": the KV cache in shared memory, read in place by the agent.
    dma = (vc.kv_transfer_config.kv_connector_extra_config or {}).get("transfer") == "dma"
    real_rank = parallel_state.get_tensor_model_parallel_rank
    real_pp = parallel_state.get_pp_group
    for stage in range(pp):
        for r in range(tp):
            kv = Kv(rank=r, stage=stage, shared=dma)
            if tp > 1:
                parallel_state.get_tensor_model_parallel_rank = lambda r=r: r
            if pp > 1:
                group = SimpleNamespace(rank_in_group=stage, world_size=pp)
                parallel_state.get_pp_group = lambda g=group: g
            try:
                worker = KVConnectorFactory.create_connector(
                    vc, KVConnectorRole.WORKER, kv_cache_config(kv.names)
                )
            finally:
                parallel_state.get_tensor_model_parallel_rank = real_rank
                parallel_state.get_pp_group = real_pp
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            faults.rank_of[worker.agent.address] = stage * tp + r
            worker.register_kv_caches(kv.layers)
            ranks.append((worker, kv))
    model = Model()
    # The scheduler vLLM's engine core builds for the config (--async-scheduling: its
    # AsyncScheduler, which schedules a step before the previous one's output is back).
    kind = AsyncScheduler if vc.scheduler_config.async_scheduling else Scheduler
    sched = kind(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    wrong: set[tuple[str, int, int]] = set()
    load_errors = 0
    step = 0
    reset_ok = None
    outputs: dict[str, list[int]] = {}
    # Per request: the first and the last step it was scheduled in.
    timeline: dict[str, list[int]] = {}
    vllm_stats = VllmStats(vc)
    for phase, batch in enumerate([prompts] + ([then] if then is not None else [])):
        if phase:
            # New weights: every token's KV changes. vLLM's cache reset, as after a weight
            # update, must make the connector serve none of the old KV.
            model.update_weights(b"weights-after-update")
            reset_ok = sched.reset_prefix_cache(reset_connector=True)
        step, load_errors = _phase(
            vc,
            model,
            sched,
            hasher,
            ranks,
            batch,
            kill,
            step,
            load_errors,
            wrong,
            outputs,
            timeline,
            vllm_stats,
            faults.squeeze,
            faults,
        )
    _last_stats(ranks, vllm_stats)
    for worker, _ in ranks:
        worker.shutdown()
    sched.connector.shutdown()
    return {
        "outputs": outputs,
        "reset_ok": reset_ok,
        "requires_kv_delivery": sched.requires_kv_delivery,
        "wrong_blocks": len(wrong),
        "checked_blocks": model.checked,
        "load_error_blocks": load_errors,
        "scheduler": vars(sched.connector.counts),
        "worker": vars(ranks[0][0].counts),
        "workers": [vars(w.counts) for w, _ in ranks],
        "steps": step,
        "timeline": timeline,
        "faults": faults.fired,
        # Freed blocks another request took (Reuse), and those written while it held them.
        "reused_blocks": faults.reuse.taken if faults.reuse else 0,
        "overwritten_blocks": len(faults.reuse.overwritten) if faults.reuse else 0,
        "vllm_stats": vllm_stats.report(),
    }


def _last_stats(ranks, vllm_stats) -> None:
    """The engine's next step after the last request: the saves still running when it ended
    finish, and their figures reach vLLM's stat loggers as a step's would (through the
    output aggregator). A real engine reports them on its next step; this one has none."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    outs = []
    for worker, _ in ranks:
        if worker.worker is not None:
            worker.worker.drain()
        stats = worker.get_kv_connector_stats()
        outs.append(
            ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                sampled_token_ids=[],
                kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
            )
        )
    out = KVOutputAggregator(len(ranks)).aggregate(outs)
    if out is None or out.kv_connector_output is None:
        return
    st = out.kv_connector_output.kv_connector_stats
    if st is not None and not st.is_empty():
        # As vLLM's scheduler hands them to its stat loggers (make_stats: to_dict()).
        vllm_stats.prom.observe(st.to_dict(), 0)
        vllm_stats.log.observe(st.to_dict())


def _phase(
    vc,
    model,
    sched,
    hasher,
    ranks,
    prompts,
    kill,
    step,
    load_errors,
    wrong,
    outputs,
    timeline,
    vllm_stats,
    squeeze,
    faults=None,
):
    """Runs ``prompts`` through the scheduler and every TP rank's worker until all are
    done (or aborted: ``faults.aborts``)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.forward_context import set_forward_context
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    reqs = {}
    # Requests the client aborts, by the step before which it does (whatever they are doing
    # then: waiting, loading, running, or done already).
    abort_at = faults.draw_aborts([p["id"] for p in prompts], step) if faults else {}
    reuse = faults.reuse if faults else None
    # Each request's LoRA adapter's weights, read as the model loads them (b"": none).
    adapters: dict[str, bytes] = {}
    for p in prompts:
        lora = None
        adapters[p["id"]] = b""
        if p.get("lora"):
            name = p["lora"]
            path = LORAS[name]
            lora = LoRARequest(name, 1 + sorted(LORAS).index(name), path)
            adapters[p["id"]] = (Path(path) / "adapter_model.safetensors").read_bytes()
        reqs[p["id"]] = Request(
            p["id"],
            p["tokens"],
            SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True),
            None,
            lora_request=lora,
            cache_salt=p.get("salt"),
            block_hasher=hasher,
        )
        sched.add_request(reqs[p["id"]])
    aggregator = KVOutputAggregator(len(ranks))
    started = time.monotonic()
    deadline = started + 600
    idle = 0
    # Steps run but whose output the scheduler has not taken yet, as many as vLLM's engine
    # core keeps (its executor's max_concurrent_batches): two under async scheduling, one
    # per pipeline stage under PP, else one (step_with_batch_queue schedules and runs step
    # N+1 before it takes step N's output).
    pp = vc.parallel_config.pipeline_parallel_size
    depth = 2 if vc.scheduler_config.async_scheduling else pp
    inflight: collections.deque[dict] = collections.deque()
    # Tokens sampled in steps whose output the scheduler has not taken (its placeholders).
    unsent: dict[str, list[tuple[int, int]]] = {}

    def known(rid: str) -> list[int]:
        """The request's tokens as the model runner knows them: the scheduler's, then those
        it sampled in steps whose output the scheduler has not taken yet."""
        return list(reqs[rid].all_token_ids) + [t for _, t in unsent.get(rid, ())]

    def execute(so, step: int) -> dict:
        """One step on every rank: the connector's hooks around the forward pass, the
        sampled tokens, and what the step's reads would say against the oracle."""
        blocks = {
            rid: list(sched.kv_cache_manager.get_block_ids(rid)[0])
            for rid in so.num_scheduled_tokens
        }
        starts = {
            rid: reqs[rid].num_computed_tokens - n  # the scheduler advanced it already
            for rid, n in so.num_scheduled_tokens.items()
        }
        for rid in so.num_scheduled_tokens:
            timeline.setdefault(rid, [step, step])[1] = step
            vllm_stats.admitted.setdefault(rid, round(time.monotonic() - started, 3))
        outs = []
        kvs = [kv for _, kv in ranks]
        tokens = {rid: known(rid) for rid in so.num_scheduled_tokens}
        with contextlib.ExitStack() as stack:
            stack.enter_context(set_forward_context(None, vc))
            for worker, _ in ranks:
                kv_transfer_state._KV_CONNECTOR_AGENT = worker
                # As vLLM's model runner does before the forward: saves still reading
                # preempted requests' blocks end before the step writes into them.
                worker.handle_preemptions(so.kv_connector_metadata)
                # Each rank's loads before the forward (its saves after it, on exit).
                outs.append(
                    stack.enter_context(KVConnectorModelRunnerMixin._get_kv_connector_output(so))
                )
            if reuse is not None and so.preempted_req_ids:
                # The preempted requests' blocks are vLLM's to reuse from here on.
                reuse.take(sched, kvs)
            # The forward pass, on every rank at once (its all-reduce mixes them).
            for rid, n in so.num_scheduled_tokens.items():
                end = starts[rid] + n
                r = reqs[rid]
                assert len(tokens[rid]) >= end, (
                    f"{rid}: position {end - 1} has no token yet (step {step}: "
                    f"{len(r.all_token_ids)} tokens, {r.num_computed_tokens} computed, "
                    f"{r.num_output_placeholders} placeholders, unsent {unsent.get(rid)}, "
                    f"scheduled {starts[rid]}..{end}, status {r.status}, "
                    f"preemptions {r.num_preemptions})"
                )
                model.forward(kvs, tokens[rid], blocks[rid], starts[rid], end, adapters[rid])
            # Leaving the stack ends each rank's step: its saves, then what it reports.
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req_ids.append(rid)
            end = starts[rid] + n
            if end >= len(tokens[rid]):
                t = Model.sample(kvs[0], blocks[rid], end)
                sampled.append([t])
                if depth > 1:
                    unsent.setdefault(rid, []).append((step, t))
            else:
                sampled.append([])
        # Every block this step's attention read, as it is now (the next step may write
        # before this one's output is taken): held against the oracle, and counted wrong
        # once the output is taken if the step stands for the request.
        reads = {
            rid: (
                starts[rid] + n,
                model.wrong_blocks(
                    kvs, rid, tokens[rid], blocks[rid], starts[rid] + n, adapters[rid]
                ),
            )
            for rid, n in so.num_scheduled_tokens.items()
        }
        # vLLM's output aggregator over the TP ranks, as its executor runs it: a request's
        # async load is done when every rank finished it, and a block that failed to load
        # on any rank failed.
        out = aggregator.aggregate(
            [
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=o,
                )
                for o in outs
            ]
        )
        assert out is not None and out.kv_connector_output is not None
        return {"so": so, "out": out, "step": step, "reads": reads}

    while sched.has_requests() or inflight:
        if sched.has_requests():
            step += 1
            if kill and step == kill[1]:
                os.kill(kill[0], kill[2])
                vllm_stats.killed = True
            gone = [r for r, at in abort_at.items() if at == step and not reqs[r].is_finished()]
            if gone:
                # As vLLM's engine core aborts a request its client left; what it frees
                # (all but blocks the connector keeps for saves) is another's at once.
                sched.finish_requests(gone, RequestStatus.FINISHED_ABORTED)
                faults.fired["abort"] += len(gone)
                if reuse is not None:
                    reuse.take(sched, [kv for _, kv in ranks])
            if reuse is not None:
                reuse.release(sched, [kv for _, kv in ranks])
            if squeeze is not None:
                squeeze.before(sched)
            so = sched.schedule()
            if squeeze is not None:
                squeeze.after(sched, so)
            if inflight:
                vllm_stats.overlapped_steps += 1
            inflight.appendleft(execute(so, step))
            ran = so.total_num_scheduled_tokens > 0
            if not ran:
                # Every request waits (for an async load): let the I/O threads run.
                idle += 1
                time.sleep(0.002)
            if len(inflight) < depth and (ran or sched.has_requests()):
                continue
        done = inflight.pop()
        so, out = done["so"], done["out"]
        invalid = out.kv_connector_output.invalid_block_ids or set()
        load_errors += len(invalid)
        vllm_stats.held_released += len(out.kv_connector_output.finished_sending or ())
        # Invalid blocks go back to the scheduler, which rolls their requests back. Its
        # stats go where vLLM's stat loggers take them: the connector's transfer figures to
        # its Prometheus metrics and its log, the hits by tier to its prefix-cache stats.
        outputs_before = {rid: len(reqs[rid].output_token_ids) for rid in so.num_scheduled_tokens}
        for eco in sched.update_from_output(so, out).values():
            st = eco.scheduler_stats
            if st is None:
                continue
            if st.kv_connector_stats:
                vllm_stats.prom.observe(st.kv_connector_stats, 0)
                vllm_stats.log.observe(st.kv_connector_stats)
            cp = st.connector_prefix_cache_stats
            if cp is not None:
                for src, n in cp.hits_by_source.items():
                    key = getattr(src, "value", str(src))
                    vllm_stats.hits[key] = vllm_stats.hits.get(key, 0) + n
        if faults is not None and faults.stalled and invalid:
            # The stalled Load failed: its client gives up on the request. Never the first
            # request, which runs to its end so that the run checks blocks at all (drawn
            # aborts spare it too; review of issue 61: seed 1372401902 aborted every request
            # of a worker, the first by this stall, and failed as vacuous).
            faults.stalled = False
            first = next(iter(reqs), None)
            owners = [
                r
                for r in list(sched.requests)
                if r != first and invalid & set(sched.kv_cache_manager.get_block_ids(r)[0])
            ]
            if owners:
                sched.finish_requests(owners, RequestStatus.FINISHED_ABORTED)
                faults.fired["abort"] += len(owners)
                if reuse is not None:
                    reuse.take(sched, [kv for _, kv in ranks])
            faults.taken.set()
        for rid, (upto, bad) in done["reads"].items():
            if bad and len(reqs[rid].output_token_ids) > outputs_before[rid]:
                # vLLM kept a token this step sampled over wrong blocks, whatever it rolled
                # back (with steps in flight it may keep one; review of issue 61, PP 2).
                for r, b in bad:
                    wrong.add((rid, b, r))
                vllm_stats.kept_over_wrong += 1
                continue
            if reqs[rid].num_computed_tokens < upto:
                # Rolled back for a failed load: it reruns the step, and what this step read
                # does not count (a token vLLM kept from it is caught above). What steps in
                # flight sampled for it is not the model runner's any more.
                unsent.pop(rid, None)
                continue
            if rid in unsent:
                # The scheduler took what this step sampled (its tokens now).
                unsent[rid] = [(s, t) for s, t in unsent[rid] if s != done["step"]]
            for r, b in bad:
                wrong.add((rid, b, r))
        assert step - idle < 10_000 and time.monotonic() < deadline, "the engine loop does not end"
    if reuse is not None:
        reuse.release(sched, [kv for _, kv in ranks], wait=True)
    for rid, r in reqs.items():
        outputs[rid] = list(r.output_token_ids)
        vllm_stats.preemptions += r.num_preemptions
    return step, load_errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-transfer-config", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill", help="PID@STEP: SIGKILL PID before step STEP")
    ap.add_argument("--stop", help="PID@STEP: SIGSTOP PID before step STEP (a hung agent)")
    ap.add_argument("--served-name", help="the served alias (--served-model-name)")
    ap.add_argument("--variant", type=int, default=0, help="which checkpoint (0, 1, ...)")
    ap.add_argument("--kv-dtype", default="auto", help="--kv-cache-dtype")
    ap.add_argument("--dp-rank", type=int, default=0, help="the data-parallel rank")
    ap.add_argument("--pp-stage", type=int, default=0, help="the pipeline stage this worker is")
    ap.add_argument("--reset-then", help="after the prompts: new weights, a reset, FILE")
    ap.add_argument("--fail-copy", choices=["load", "save"], help="the first copy raises")
    ap.add_argument("--time-out", choices=["load", "save"], help="the first call times out")
    ap.add_argument(
        "--fail-new-staging", type=int, default=0, help="N: staging pools 2..N+1 fail to start"
    )
    ap.add_argument("--tp", type=int, default=1, help="TP ranks, one worker each")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages, TP ranks each")
    ap.add_argument("--slow-save", type=float, default=0.0, help="SECONDS before every save")
    ap.add_argument(
        "--late-save",
        type=float,
        default=0.0,
        help="SECONDS: the save in flight at the first preemption goes out that much later",
    )
    ap.add_argument("--mla", action="store_true", help="an MLA model (DeepSeek-V2 shaped)")
    ap.add_argument("--blocks", type=int, help="KV blocks (fewer: vLLM preempts requests)")
    ap.add_argument(
        "--squeeze", action="store_true", help="take the free blocks until vLLM preempts one"
    )
    ap.add_argument(
        "--spec",
        choices=["full", "sliding_window", "chunked_local"],
        default="full",
        help="the KV cache spec vLLM hands the connector",
    )
    ap.add_argument(
        "--lora", action="append", default=[], help="NAME=PATH: a LoRA adapter prompts may name"
    )
    ap.add_argument("--max-batched-tokens", type=int, default=256, help="fewer: chunked prefill")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's AsyncScheduler: a step scheduled before the last one's output is back",
    )
    ap.add_argument("--seed", type=int, default=0, help="the faults' random generator")
    ap.add_argument("--aborts", type=float, default=0.0, help="P: the client aborts a request")
    ap.add_argument(
        "--stall-load", type=int, help="PID: kvtierd stopped through the second Load's deadline"
    )
    ap.add_argument("--short-loads", type=float, default=0.0, help="P: a Load asks for fewer")
    ap.add_argument(
        "--drop-saves", action="append", default=[], help="RANK:P: that rank's saves are lost"
    )
    a = ap.parse_args()
    if a.blocks:
        global NUM_BLOCKS
        NUM_BLOCKS = a.blocks
    kill = None
    for spec, sig in ((a.kill, signal.SIGKILL), (a.stop, signal.SIGSTOP)):
        if spec:
            pid, at = spec.split("@")
            kill = (int(pid), int(at), sig)
    MLA[0] = a.mla
    SPEC[0] = a.spec
    LORAS.update(x.split("=", 1) for x in a.lora)
    FIRST_STAGE[0] = a.pp_stage
    vc = config(
        a.kv_transfer_config,
        served_name=a.served_name,
        variant=a.variant,
        kv_dtype=a.kv_dtype,
        dp_rank=a.dp_rank,
        tp=a.tp,
        pp=a.pp,
        max_batched_tokens=a.max_batched_tokens,
        async_scheduling=a.async_scheduling,
    )
    drops = {int(r): float(p) for r, p in (d.split(":") for d in a.drop_saves)}
    faults = Faults(
        a.seed,
        a.short_loads,
        drops,
        a.squeeze,
        a.late_save,
        a.aborts,
        a.stall_load,
        block=BLOCK,
    )
    then = json.loads(Path(a.reset_then).read_text()) if a.reset_then else None
    result = run(
        vc,
        json.loads(Path(a.prompts).read_text()),
        kill,
        then,
        a.fail_copy,
        a.time_out,
        a.slow_save,
        faults,
        a.fail_new_staging,
    )
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
