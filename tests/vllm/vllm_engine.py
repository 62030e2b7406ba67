"""One vLLM worker's engine loop on CPU, with vLLM's own classes, for the connector tests.

Run as a script (one process per worker, as vLLM runs them)::

    python vllm_engine.py --kv-transfer-config JSON --prompts FILE --out FILE [--kill PID@STEP]
        [--served-name NAME] [--variant N] [--kv-dtype DTYPE] [--dp-rank N] [--pp-stage N]
        [--reset-then FILE] [--fail-copy load|save] [--time-out load|save] [--tp N] [--mla]
        [--blocks N]

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
aggregator merges them), and
an MLA model (``--mla``: a DeepSeek-V2-shaped config, whose latent is the same on every rank).

It builds the ``VllmConfig`` from the same ``--kv-transfer-config`` flag ``vllm serve`` takes,
parsed by vLLM's own argument parser; creates the connector through vLLM's factory (which
loads ``kvtier.vllm`` by its module path) on both sides; and drives vLLM's ``Scheduler``
(its KV cache manager, block pool and prefix cache), real ``Request`` objects and the model
runner's connector hooks (``KVConnectorModelRunnerMixin``), step by step until every request
is done.

The one part that is not vLLM's is the forward pass: vLLM's CPU attention kernels
(``vllm._C``) are not in the PyPI wheel, which is built for CUDA. In its place each step
writes every scheduled token's KV as a pure function of the tokens up to it (a SHA-256
chain), into the blocks vLLM's slot mapping names, exactly where the model would write it.
So "bit-identical to recomputing" is checked directly: after each step, every block vLLM
counts as computed must hold the bytes recomputing would give. The sampled token is a
function of the KV too, so a wrong block would also change the outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK = 16
HEADS, HEAD = 2, 16
# MLA: the latent (kv_lora_rank 32) and the rope part (16) of one token.
LORA, ROPE = 32, 16
LAYERS = 2
NUM_BLOCKS = 203  # not 2, not 16: the block dimension is found by its size
# This worker's attention layers; a PP stage's are set by --pp-stage.
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
# Set by --mla.
MLA = [False]


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
    pc = ParallelConfig(tensor_parallel_size=tp)
    # The DP rank as vLLM's engine core sets it for a rank on this node.
    pc.data_parallel_rank = pc.data_parallel_rank_local = dp_rank
    vc = VllmConfig(
        model_config=mc,
        parallel_config=pc,
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, cache_dtype=kv_dtype
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=256,
            max_num_seqs=16,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def kv_cache_config():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    if MLA[0]:
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
        kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)],
    )


class Kv:
    """One TP rank's KV of every token, as a pure function of the weights, the rank (MHA: each
    rank holds other heads; MLA: the same latent on every rank) and the tokens up to it."""

    def __init__(self, weights: bytes = b"", rank: int = 0):
        self.weights = weights
        self.rank = 0 if MLA[0] else rank
        # vLLM's CPU attention layout: [num_blocks, num_kv_heads, block_size, 2 * head_size];
        # MLA's: [num_blocks, block_size, kv_lora_rank + rope_dim].
        shape = (NUM_BLOCKS, BLOCK, LORA + ROPE) if MLA[0] else (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
        self.layers = {n: torch.zeros(*shape, dtype=torch.bfloat16) for n in LAYER_NAMES}
        self.chains: dict[str, list[bytes]] = {}

    def update_weights(self, weights: bytes) -> None:
        """Other weights: the same tokens' KV changes."""
        self.weights = weights
        self.chains.clear()

    def chain(self, req_id: str, tokens: list[int], upto: int) -> list[bytes]:
        c = self.chains.setdefault(req_id, [])
        while len(c) < upto:
            prev = c[-1] if c else b""
            prev = prev or self.weights
            c.append(hashlib.sha256(prev + tokens[len(c)].to_bytes(4, "little")).digest())
        return c

    def token_kv(self, digest: bytes, layer: int) -> torch.Tensor:
        shape = (LORA + ROPE,) if MLA[0] else (HEADS, 2 * HEAD)
        n = 2 * int(torch.Size(shape).numel())  # bytes of one token's KV in one layer
        raw = b""
        i = 0
        while len(raw) < n:
            raw += hashlib.sha256(digest + bytes([layer, i, self.rank])).digest()
            i += 1
        # As int16 bit patterns: any bytes are a valid bf16 tensor to store and compare.
        return torch.frombuffer(bytearray(raw[:n]), dtype=torch.int16).view(*shape)

    def slot(self, name: str, block: int, off: int) -> torch.Tensor:
        """One token's KV in one layer, where vLLM's slot mapping puts it."""
        t = self.layers[name].view(torch.int16)
        return t[block, off, :] if MLA[0] else t[block, :, off, :]

    def write(self, req_id: str, tokens: list[int], blocks: list[int], start: int, end: int):
        c = self.chain(req_id, tokens, end)
        for pos in range(start, end):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for li, name in enumerate(LAYER_NAMES):
                self.slot(name, b, off)[...] = self.token_kv(c[pos], li)

    def wrong_blocks(self, req_id: str, tokens: list[int], blocks: list[int], upto: int):
        """Blocks among the first ``upto`` tokens' that differ from recomputing them."""
        c = self.chain(req_id, tokens, upto)
        wrong = set()
        for pos in range(upto):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for li, name in enumerate(LAYER_NAMES):
                if not torch.equal(self.slot(name, b, off), self.token_kv(c[pos], li)):
                    wrong.add(b)
        return wrong

    def sample(self, req_id: str, tokens: list[int], n: int) -> int:
        """The next token: a function of the last token's KV as stored in its block."""
        return int.from_bytes(self.chain(req_id, tokens, n)[n - 1][:2], "little") % 1000


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
        }


def run(
    vc,
    prompts: list[dict],
    kill: tuple[int, int] | None,
    then: list[dict] | None = None,
    fail_copy: str | None = None,
    time_out: str | None = None,
    slow_save: float = 0.0,
) -> dict:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kcc = kv_cache_config()
    tp = vc.parallel_config.tensor_parallel_size
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
        _time_out_first(time_out)
    if slow_save:
        # Every SaveBatch goes out late, as to an L2 that answers slowly: the save thread
        # runs behind the engine, and each step's copies start that much later.
        from kvtier.agent import AgentClient

        save_batch = AgentClient.save_batch

        def late(self, *a, **k):
            time.sleep(slow_save)
            return save_batch(self, *a, **k)

        AgentClient.save_batch = late
    # Each TP rank's connector, made by vLLM's factory from the flag, registered as the
    # model runner registers it, while vLLM's parallel state says which rank it is.
    from vllm.distributed import parallel_state

    ranks = []
    real_rank = parallel_state.get_tensor_model_parallel_rank
    for r in range(tp):
        kv = Kv(rank=r)
        if tp > 1:
            parallel_state.get_tensor_model_parallel_rank = lambda r=r: r
        try:
            worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
        finally:
            parallel_state.get_tensor_model_parallel_rank = real_rank
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        worker.register_kv_caches(kv.layers)
        ranks.append((worker, kv))
    sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)
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
            for _, kv in ranks:
                kv.update_weights(b"weights-after-update")
            reset_ok = sched.reset_prefix_cache(reset_connector=True)
        step, load_errors = _phase(
            vc,
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
        )
    for worker, _ in ranks:
        worker.shutdown()
    sched.connector.shutdown()
    return {
        "outputs": outputs,
        "reset_ok": reset_ok,
        "requires_kv_delivery": sched.requires_kv_delivery,
        "wrong_blocks": len(wrong),
        "load_error_blocks": load_errors,
        "scheduler": vars(sched.connector.counts),
        "worker": vars(ranks[0][0].counts),
        "workers": [vars(w.counts) for w, _ in ranks],
        "steps": step,
        "timeline": timeline,
        "vllm_stats": vllm_stats.report(),
    }


def _time_out_first(which: str) -> None:
    """The first agent Load (or Save) goes out for real on a thread of its own and is
    reported to the connector as past its deadline at once: the agent may still be copying
    in the staging pool when the connector moves on."""
    import threading

    import grpc

    from kvtier.agent import AgentClient
    from kvtier.host import KvtierError

    name = {"load": "load_pages", "save": "save_batch"}[which]
    real = getattr(AgentClient, name)
    fired = []

    def timed_out(self, *a, **k):
        if fired:
            return real(self, *a, **k)
        t = threading.Thread(target=lambda: _quietly(real, self, *a, **k), daemon=True)
        fired.append(t)
        t.start()
        raise KvtierError(
            f"{name}: deadline exceeded (injected)", grpc.StatusCode.DEADLINE_EXCEEDED
        )

    setattr(AgentClient, name, timed_out)


def _quietly(fn, *a, **k):
    try:
        fn(*a, **k)
    except Exception:  # noqa: BLE001 - the late call's outcome is the test's to observe
        pass


def _phase(
    vc, sched, hasher, ranks, prompts, kill, step, load_errors, wrong, outputs, timeline, vllm_stats
):
    """Runs ``prompts`` through the scheduler and every TP rank's worker until all are
    done."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.forward_context import set_forward_context
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    reqs = {}
    for p in prompts:
        reqs[p["id"]] = Request(
            p["id"],
            p["tokens"],
            SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True),
            None,
            cache_salt=p.get("salt"),
            block_hasher=hasher,
        )
        sched.add_request(reqs[p["id"]])
    aggregator = KVOutputAggregator(len(ranks))
    deadline = time.monotonic() + 600
    idle = 0
    while sched.has_requests():
        step += 1
        if kill and step == kill[1]:
            os.kill(kill[0], signal.SIGKILL)
        so = sched.schedule()
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
        outs = []
        for worker, kv in ranks:
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            # As vLLM's model runner does before the forward: saves still reading preempted
            # requests' blocks end before the step writes into them.
            worker.handle_preemptions(so.kv_connector_metadata)
            with (
                set_forward_context(None, vc),
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out,
            ):
                for rid, n in so.num_scheduled_tokens.items():
                    tokens = list(reqs[rid].all_token_ids)
                    kv.write(rid, tokens, blocks[rid], starts[rid], starts[rid] + n)
            outs.append(kv_out)
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            all_tokens = list(reqs[rid].all_token_ids)
            req_ids.append(rid)
            if reqs[rid].num_computed_tokens >= len(all_tokens):
                sampled.append([ranks[0][1].sample(rid, all_tokens, len(all_tokens))])
            else:
                sampled.append([])
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
        load_errors += len(out.kv_connector_output.invalid_block_ids or ())
        vllm_stats.held_released += len(out.kv_connector_output.finished_sending or ())
        # Invalid blocks go back to the scheduler, which rolls their requests back. Its
        # stats go where vLLM's stat loggers take them: the connector's transfer figures to
        # its Prometheus metrics and its log, the hits by tier to its prefix-cache stats.
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
        if not so.num_scheduled_tokens:
            # Every request waits (for an async load): let the I/O threads run.
            idle += 1
            time.sleep(0.002)
        # Every block this step's attention read, for each request whose step stands (a
        # request rolled back for a failed load reruns it; vLLM drops its output), holds
        # what recomputing it gives. Nothing has been written since the forward pass.
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            upto = starts[rid] + n
            if req.num_computed_tokens < upto:
                continue
            for r, (_, kv) in enumerate(ranks):
                for b in kv.wrong_blocks(rid, list(req.all_token_ids), blocks[rid], upto):
                    wrong.add((rid, b, r))
        assert step - idle < 10_000 and time.monotonic() < deadline, "the engine loop does not end"
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
    ap.add_argument("--served-name", help="the served alias (--served-model-name)")
    ap.add_argument("--variant", type=int, default=0, help="which checkpoint (0, 1, ...)")
    ap.add_argument("--kv-dtype", default="auto", help="--kv-cache-dtype")
    ap.add_argument("--dp-rank", type=int, default=0, help="the data-parallel rank")
    ap.add_argument("--pp-stage", type=int, default=0, help="the pipeline stage this worker is")
    ap.add_argument("--reset-then", help="after the prompts: new weights, a reset, FILE")
    ap.add_argument("--fail-copy", choices=["load", "save"], help="the first copy raises")
    ap.add_argument("--time-out", choices=["load", "save"], help="the first call times out")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks, one worker each")
    ap.add_argument("--slow-save", type=float, default=0.0, help="SECONDS before every save")
    ap.add_argument("--mla", action="store_true", help="an MLA model (DeepSeek-V2 shaped)")
    ap.add_argument("--blocks", type=int, help="KV blocks (fewer: vLLM preempts requests)")
    a = ap.parse_args()
    if a.blocks:
        global NUM_BLOCKS
        NUM_BLOCKS = a.blocks
    kill = None
    if a.kill:
        pid, at = a.kill.split("@")
        kill = (int(pid), int(at))
    MLA[0] = a.mla
    if a.pp_stage:
        LAYER_NAMES[:] = [
            f"model.layers.{a.pp_stage * LAYERS + i}.self_attn.attn" for i in range(LAYERS)
        ]
    vc = config(
        a.kv_transfer_config,
        served_name=a.served_name,
        variant=a.variant,
        kv_dtype=a.kv_dtype,
        dp_rank=a.dp_rank,
        tp=a.tp,
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
    )
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
