"""One vLLM worker's engine loop on CPU, with vLLM's own classes, for the connector tests.

Run as a script (one process per worker, as vLLM runs them)::

    python vllm_engine.py --kv-transfer-config JSON --prompts FILE --out FILE [--kill PID@STEP]

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
from pathlib import Path

import torch

BLOCK = 16
HEADS, HEAD = 2, 16
LAYERS = 2
NUM_BLOCKS = 203  # not 2, not 16: the block dimension is found by its size
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def model_dir() -> str:
    """A model directory with only a tiny Llama's config.json: no weights are loaded. The
    same path in every worker: the model's name is part of the layout fingerprint."""
    d = Path(tempfile.gettempdir()) / "kvtier-vllm-tiny-llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HEADS * 2 * HEAD,
                "num_attention_heads": HEADS * 2,
                "num_key_value_heads": HEADS,
                "num_hidden_layers": LAYERS,
                "intermediate_size": 128,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return str(d)


def config(kv_transfer_json: str):
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The flag exactly as `vllm serve` parses it.
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", kv_transfer_json])
    ktc = EngineArgs.from_cli_args(args).kv_transfer_config
    from vllm.config import ModelConfig

    mc = ModelConfig(
        model=model_dir(), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16"
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
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
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)],
    )


class Kv:
    """The KV of every token, as a pure function of the tokens up to it."""

    def __init__(self):
        # vLLM's CPU attention layout: [num_blocks, num_kv_heads, block_size, 2 * head_size].
        self.layers = {
            n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
            for n in LAYER_NAMES
        }
        self.chains: dict[str, list[bytes]] = {}

    def chain(self, req_id: str, tokens: list[int], upto: int) -> list[bytes]:
        c = self.chains.setdefault(req_id, [])
        while len(c) < upto:
            prev = c[-1] if c else b""
            c.append(hashlib.sha256(prev + tokens[len(c)].to_bytes(4, "little")).digest())
        return c

    @staticmethod
    def token_kv(digest: bytes, layer: int) -> torch.Tensor:
        n = HEADS * 2 * HEAD * 2  # bytes of one token's K and V in one layer
        raw = b""
        i = 0
        while len(raw) < n:
            raw += hashlib.sha256(digest + bytes([layer, i])).digest()
            i += 1
        # As int16 bit patterns: any bytes are a valid bf16 tensor to store and compare.
        return torch.frombuffer(bytearray(raw[:n]), dtype=torch.int16).view(HEADS, 2 * HEAD)

    def write(self, req_id: str, tokens: list[int], blocks: list[int], start: int, end: int):
        c = self.chain(req_id, tokens, end)
        for pos in range(start, end):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for li, name in enumerate(LAYER_NAMES):
                self.layers[name].view(torch.int16)[b, :, off, :] = self.token_kv(c[pos], li)

    def wrong_blocks(self, req_id: str, tokens: list[int], blocks: list[int], upto: int):
        """Blocks among the first ``upto`` tokens' that differ from recomputing them."""
        c = self.chain(req_id, tokens, upto)
        wrong = set()
        for pos in range(upto):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for li, name in enumerate(LAYER_NAMES):
                got = self.layers[name].view(torch.int16)[b, :, off, :]
                if not torch.equal(got, self.token_kv(c[pos], li)):
                    wrong.add(b)
        return wrong

    def sample(self, req_id: str, tokens: list[int], n: int) -> int:
        """The next token: a function of the last token's KV as stored in its block."""
        return int.from_bytes(self.chain(req_id, tokens, n)[n - 1][:2], "little") % 1000


def run(vc, prompts: list[dict], kill: tuple[int, int] | None) -> dict:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    kcc = kv_cache_config()
    kv = Kv()
    # The worker's connector, made by vLLM's factory from the flag, registered as the
    # model runner registers it.
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    worker.register_kv_caches(kv.layers)
    sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
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
    wrong: set[tuple[str, int]] = set()
    load_errors = 0
    step = 0
    while sched.has_requests():
        step += 1
        if kill and step == kill[1]:
            os.kill(kill[0], signal.SIGKILL)
        so = sched.schedule()
        blocks = {
            rid: list(sched.kv_cache_manager.get_block_ids(rid)[0])
            for rid in so.num_scheduled_tokens
        }
        starts: dict[str, int] = {}
        with (
            set_forward_context(None, vc),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out,
        ):
            for rid, n in so.num_scheduled_tokens.items():
                req = reqs[rid]
                start = req.num_computed_tokens - n  # the scheduler advanced it already
                starts[rid] = start
                kv.write(rid, list(req.all_token_ids), blocks[rid], start, start + n)
        load_errors += len(kv_out.invalid_block_ids)
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            all_tokens = list(reqs[rid].all_token_ids)
            req_ids.append(rid)
            if reqs[rid].num_computed_tokens >= len(all_tokens):
                sampled.append([kv.sample(rid, all_tokens, len(all_tokens))])
            else:
                sampled.append([])
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        # Invalid blocks go back to the scheduler, which rolls their requests back.
        sched.update_from_output(so, out)
        # Every block this step's attention read, for each request whose step stands (a
        # request rolled back for a failed load reruns it; vLLM drops its output), holds
        # what recomputing it gives. Nothing has been written since the forward pass.
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            upto = starts[rid] + n
            if req.num_computed_tokens < upto:
                continue
            for b in kv.wrong_blocks(rid, list(req.all_token_ids), blocks[rid], upto):
                wrong.add((rid, b))
        assert step < 10_000, "the engine loop does not end"
    worker.shutdown()
    sched.connector.shutdown()
    return {
        "outputs": {rid: list(r.output_token_ids) for rid, r in reqs.items()},
        "wrong_blocks": len(wrong),
        "load_error_blocks": load_errors,
        "scheduler": vars(sched.connector.counts),
        "worker": vars(worker.counts),
        "steps": step,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-transfer-config", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill", help="PID@STEP: SIGKILL PID before step STEP")
    a = ap.parse_args()
    kill = None
    if a.kill:
        pid, at = a.kill.split("@")
        kill = (int(pid), int(at))
    result = run(config(a.kv_transfer_config), json.loads(Path(a.prompts).read_text()), kill)
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
