"""kvtier as a secondary tier of vLLM's own KV offloading (``kvtier.integrations.vllm.tier``),
with a real kvtierd and vLLM's own classes.

Each "instance" is one vLLM engine's scheduler side: the ``--kv-transfer-config`` flag of
docs/vllm.md parsed by vLLM's own argument parser, vLLM's ``OffloadingConnector`` built from
it (its ``TieringOffloadingSpec`` loads the tier through ``SecondaryTierFactory`` by
``type`` and ``module_path``), and vLLM's ``TieringOffloadingManager`` driven as vLLM's
scheduler drives it: ``prepare_store``/``complete_store`` for a request's new chunks (which
cascades them to the tier), ``lookup`` chunk by chunk every step (the tier answers "retry"
until its lookup thread has kvtierd's answer; a hit is promoted into the CPU tier), and
``on_schedule_end`` at the end of each step. The one part that is not vLLM's is the GPU
worker (it needs CUDA): in its place the test writes each chunk's bytes into vLLM's shared
CPU region where the worker would, and reads them back from where ``prepare_load`` says.

Every chunk's bytes are distinct random bytes derived from its key, so a chunk loaded into
another chunk's row, or not copied at all, is seen.

Run as a script (``python test_vllm_tier.py load ARGS.json``) it is a second vLLM instance in
a process of its own, which loads prompts and writes what it found.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.testing import Kvtierd

BLOCK = 16
HEADS, HEAD = 2, 16
LAYERS = 2
NUM_BLOCKS = 64
# Chunks of vLLM's CPU tier (one block each: 2 layers x 2048 bytes).
CPU_CHUNKS = 64


def tier_flag(socket: str, **tier: Any) -> str:
    """The --kv-transfer-config flag exactly as docs/vllm.md gives it; ``tier``: more keys of
    the tier's entry."""
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": CPU_CHUNKS * 4096,
                "secondary_tiers": [
                    {
                        "type": "kvtier",
                        "module_path": "kvtier.integrations.vllm.tier",
                        "socket": socket,
                        **tier,
                    }
                ],
            },
        }
    )


def model_dir(root: Path) -> str:
    """A tiny Llama's config.json (no weights are loaded): the same path in every instance."""
    d = root / "tiny-llama"
    d.mkdir(exist_ok=True)
    cfg = {
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
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def prompt(seed: int, chunks: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(chunks * BLOCK)]


def chunk_keys(tokens: list[int]) -> list[bytes]:
    """vLLM's offload keys of a prompt's full chunks: its block hashes (sha256, vLLM's
    default, with its fixed seed) and KV cache group 0."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key

    kv_cache_utils.init_none_hash(sha256)
    keys, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i : i + BLOCK])
        keys.append(bytes(make_offload_key(parent, 0)))
    return keys


def chunk_bytes(key: bytes, n: int) -> bytes:
    """A chunk's bytes: random, from its key (so no two chunks share them)."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


class Instance:
    """One vLLM instance's scheduler side over vLLM's shared CPU region (module docstring)."""

    def __init__(self, model: str, kv_flag: str):
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

        from kvtier.integrations.vllm.tier import KvtierTier

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--kv-transfer-config", kv_flag])
        assert args is not None
        ktc = EngineArgs.from_cli_args(args).kv_transfer_config
        vc = VllmConfig(
            model_config=ModelConfig(
                model=model, skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16"
            ),
            parallel_config=ParallelConfig(),
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
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        page = spec.page_size_bytes
        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * LAYERS * NUM_BLOCKS,
                    layers=names,
                    layer_stride=page * NUM_BLOCKS,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        self.connector = OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        manager = self.connector.scheduler.manager
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KvtierTier), type(tier)
        self.tier = tier
        region = manager.primary_tier.get_kv_memoryview()
        assert region.strides is not None
        self.stride = region.strides[0]
        # The region's rows (vLLM's chunks), as the GPU worker writes and reads them.
        self.rows = np.asarray(region).view(np.uint8)
        self._n = 0

    def _ctx(self, name: str):
        from vllm.v1.kv_offload.base import ReqContext

        self._n += 1
        ctx = ReqContext(req_id=f"{name}-{self._n}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 30.0) -> None:
        """Steps until no tier job is in flight (vLLM keeps stepping while one is)."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "tier jobs still in flight"
            time.sleep(0.005)

    def store(self, tokens: list[int]) -> None:
        """A request's chunks computed and offloaded: into vLLM's CPU tier (the bytes written
        where the GPU worker would), then cascaded to the tier."""
        from vllm.v1.kv_offload.base import OffloadKey
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        keys = [OffloadKey(k) for k in chunk_keys(tokens)]
        ctx = self._ctx("store")
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "vLLM's CPU tier took none of the chunks"
        spec = out.store_spec
        assert isinstance(spec, CPULoadStoreSpec)
        for key, row in zip(out.keys_to_store, spec.chunk_ids):
            self.rows[int(row)] = np.frombuffer(chunk_bytes(key, self.stride), np.uint8)
        with self.manager.lock:
            if out.keys_to_store:
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.settle()

    def load(
        self, tokens: list[int], timeout: float = 30.0, before_promotion=None
    ) -> list[str | None]:
        """A new request for ``tokens``: vLLM's scheduler's lookup, step after step (its
        ``_maximal_prefix_lookup``: every chunk up to the first miss; a "retry" or a
        promotion in flight asks again next step), until it settles on a number of leading
        chunks; then their rows as ``prepare_load`` names them (the GPU worker's read).
        Returns each chunk's digest, or None past the hits. ``before_promotion``: called
        once, when promotions from the tier are first queued, before the step that submits
        them."""
        from vllm.v1.kv_offload.base import LookupResult, OffloadKey
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        keys = [OffloadKey(k) for k in chunk_keys(tokens)]
        ctx = self._ctx("load")
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred, promoting = 0, False, False
            with self.manager.lock:
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    if result is not LookupResult.RETRY:
                        hits += 1
                    deferred |= result is not LookupResult.HIT
                    promoting |= result is LookupResult.HIT_PENDING
            if not deferred:
                break
            if promoting and before_promotion is not None:
                before_promotion()
                before_promotion = None
            assert time.monotonic() < deadline, f"lookups still deferred after {timeout} s"
            self.step()
            time.sleep(0.005)
        got: list[str | None] = [None] * len(keys)
        with self.manager.lock:
            spec = self.manager.prepare_load(keys[:hits], ctx) if hits else None
        if spec is not None:
            assert isinstance(spec, CPULoadStoreSpec)
            for i, row in enumerate(spec.chunk_ids):
                got[i] = digest(self.rows[int(row)].tobytes())
            with self.manager.lock:
                self.manager.complete_load(keys[:hits], ctx)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        self.settle()
        return got

    def close(self) -> None:
        # No view of the region may outlive it (vLLM then keeps it mapped, and warns).
        del self.rows
        self.connector.shutdown()


def expected(tokens: list[int], stride: int) -> list[str]:
    return [digest(chunk_bytes(k, stride)) for k in chunk_keys(tokens)]


def second_instance(tmp: Path, model: str, kv_flag: str, prompts: list[list[int]]) -> dict:
    """Another vLLM instance, in a process of its own, loads ``prompts``: each chunk's digest
    (None: not loaded), and its tier's counters."""
    args = tmp / "second.json"
    out = tmp / "second.out.json"
    args.write_text(
        json.dumps({"model": model, "flag": kv_flag, "prompts": prompts, "out": str(out)})
    )
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run(
        [sys.executable, __file__, "load", str(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _second_main(args_file: str) -> None:
    a = json.loads(Path(args_file).read_text())
    inst = Instance(a["model"], a["flag"])
    try:
        found = [inst.load(p) for p in a["prompts"]]
        result = {"found": found, "stride": inst.stride, "counters": dict(inst.tier.counters)}
    finally:
        inst.close()
    Path(a["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        _second_main(sys.argv[2])
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} load ARGS.json")


# ---- the tests ----------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> str:
    return model_dir(tmp_path)


def test_a_second_instance_loads_what_the_first_stored_bit_identical(
    tmp_path: Path, model: str
) -> None:
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=256")
    try:
        first = Instance(model, tier_flag(d.socket))
        try:
            stored = [prompt(s, 6) for s in (1, 2, 3)]
            for p in stored:
                first.store(p)
            assert first.tier.counters["stored_pages"] == 18, dict(first.tier.counters)
            assert first.tier.counters["store_failed_pages"] == 0
            stride = first.stride
        finally:
            first.close()
        # A prompt sharing the first 3 chunks of prompt 1, then its own: 3 hits, then a miss.
        branch = stored[0][: 3 * BLOCK] + prompt(9, 3)
        never = prompt(10, 4)
        second = second_instance(tmp_path, model, tier_flag(d.socket), [*stored, branch, never])
        assert second["stride"] == stride
        found = second["found"]
        for p, got in zip(stored, found):
            assert got == expected(p, stride)
        assert found[3] == expected(branch, stride)[:3] + [None] * 3
        assert found[4] == [None] * 4
        # The branch's 3 chunks came from the second instance's own CPU tier (prompt 1 put
        # them there): vLLM asks its secondary tiers only for what its CPU tier lacks.
        assert second["counters"]["loaded_pages"] == 18
        # Another tenant shares nothing: its lookups all miss.
        other = second_instance(tmp_path, model, tier_flag(d.socket, tenant="b"), stored[:1])
        assert other["found"] == [[None] * 6]
    finally:
        d.stop()


def test_kvtierd_killed_and_restarted_is_misses_then_works_again(
    tmp_path: Path, model: str
) -> None:
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=256")
    quick = {
        "lookup_timeout_s": 0.5,
        "lookup_pause_s": 0.3,
        "reconnect_interval_s": 0.2,
        "timeout_s": 2.0,
    }
    writer = Instance(model, tier_flag(d.socket, **quick))
    reader = Instance(model, tier_flag(d.socket, **quick))
    try:
        stride = writer.stride
        p1, p2, p3 = prompt(21, 5), prompt(22, 5), prompt(23, 5)
        writer.store(p1)
        writer.store(p2)

        # kvtierd dies after the reader's lookup found p1's chunks and before the step that
        # submits their promotion: the load fails, its chunks are misses, and nothing else.
        t0 = time.monotonic()
        got = reader.load(p1, before_promotion=d.kill)
        assert time.monotonic() - t0 < 15
        assert got == [None] * 5, got
        # While it is down: every lookup a miss, quickly; every store a counted failure.
        t0 = time.monotonic()
        assert reader.load(p2) == [None] * 5
        assert time.monotonic() - t0 < 10
        failed = writer.tier.counters["store_failed_pages"]
        writer.store(p3)
        assert writer.tier.counters["store_failed_pages"] == failed + 5

        d.start()
        time.sleep(0.5)  # past lookup_pause_s and reconnect_interval_s
        p4 = prompt(24, 5)
        writer.store(p4)
        assert reader.load(p4) == expected(p4, stride)
        # What was stored before the crash: found again (kvtierd took over its L2 pool, and
        # wrote it to L3), bit-identical.
        assert reader.load(p2) == expected(p2, stride)
        # p3's chunks never reached kvtierd, and are not found.
        assert reader.load(p3) == [None] * 5

        # kvtierd hung (stopped, its socket still accepting): lookups end at their deadline
        # as misses, and the engine keeps stepping.
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert reader.load(p1) == [None] * 5
            assert time.monotonic() - t0 < 10
        finally:
            d.proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert reader.load(p1) == expected(p1, stride)
    finally:
        writer.close()
        reader.close()
        d.stop()


def test_a_full_l2_applies_vllms_backpressure(tmp_path: Path, model: str) -> None:
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    # 8 pages, at most half of them not yet in L3, and an L3 whose writes take a minute:
    # after 4 pages L2 has no room for a store.
    d = Kvtierd(
        tmp_path / "daemon",
        "l2.pool_pages=8",
        "l2.dirty_fraction=0.5",
        "l3.fault_set_delay=60s",
    )
    bp = {"backpressure_cls": "EMABackpressureDetector", "failure_threshold": 2}
    inst = Instance(model, tier_flag(d.socket, store_wait_s=0.2, backpressure=bp))
    try:
        detector = inst.tier.bp_detector
        assert isinstance(detector, EMABackpressureDetector)
        c = inst.tier.counters
        inst.store(prompt(31, 4))
        assert c["stored_pages"] == 4 and c["store_failed_pages"] == 0
        assert not detector.is_under_pressure()
        # L2 has no room: each store waits store_wait_s, then fails; vLLM's detector counts
        # the failures and, at its threshold, puts the tier under pressure.
        inst.store(prompt(32, 2))
        assert c["store_failed_pages"] == 2 and not detector.is_under_pressure()
        inst.store(prompt(33, 2))
        assert c["store_failed_pages"] == 4
        assert detector.is_under_pressure()
        # Under pressure vLLM drops the stores to the tier: none reaches it, and vLLM's
        # policy counts them.
        detector.policy.pop_stores_dropped()
        jobs = c["stored_pages"] + c["store_failed_pages"]
        inst.store(prompt(34, 3))
        inst.store(prompt(35, 1))
        assert c["stored_pages"] + c["store_failed_pages"] == jobs
        assert detector.policy.pop_stores_dropped() == (2, 4)
    finally:
        inst.close()
        d.kill()


def test_jobs_and_lookups_past_kvtierds_batch_limit_go_in_several_calls(
    tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's lookups, or a job, of more keys than kvtierd takes in one call
    (``server.max_batch``) are split, not refused: refused, the lookups would look like
    kvtierd down and pause every lookup. Here kvtierd takes 5 keys a call and the tier sends 4."""
    from kvtier.integrations.vllm import tier as tier_module

    monkeypatch.setattr(tier_module, "MAX_KEYS_PER_CALL", 4)
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=256", "server.max_batch=5")
    try:
        tokens = prompt(21, 12)
        first = Instance(model, tier_flag(d.socket))
        try:
            first.store(tokens)
            assert first.tier.counters["stored_pages"] == 12, dict(first.tier.counters)
            stride = first.stride
        finally:
            first.close()
        second = Instance(model, tier_flag(d.socket))
        try:
            assert second.load(tokens) == expected(tokens, stride)
            counters = dict(second.tier.counters)
            assert counters["loaded_pages"] == 12, counters
            assert not any(k.startswith("error:") for k in counters), counters
        finally:
            second.close()
    finally:
        d.stop()
