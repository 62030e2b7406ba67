"""The agent's DMA from a vLLM-shaped KV cache on a GPU (``scripts/gpu-check`` runs this where
there is one; skipped elsewhere). No vLLM is needed: the layer views are built the way vLLM
0.33 builds them (``[B, H, N, C]`` strided views of one backing allocation, the axes in the
physical order of a ``KVCacheLayout``; tests/vllm/test_vllm_blocks.py checks that arithmetic
against vLLM's own code on CPU).

A real kvtierd and kvtier-agent (``KVTIERD_BIN``, ``KVTIERAGENT_BIN``) run beside this
process; the worker's side exports the allocation by CUDA IPC handle with the pieces of a
page (``kvtier.integrations.vllm.blocks``), the agent saves blocks from it into L2 and loads
them back into other blocks, and every byte is compared. It then times a step's DMA saves and
loads against a pinned copy of the same bytes."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

# vLLM 0.33's KVCacheLayout values: the physical order of the logical axes [L, B, H, N, C].
LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_layers(order, layers: int, blocks: int, heads: int, tokens: int, head: int):
    """Per-layer ``[B, H, N, C]`` bf16 views over one CUDA allocation, as vLLM lays them out
    for ``order`` (C holds a token's K and V)."""
    c_bytes = 2 * head * 2
    shape = (layers, blocks, heads, tokens, c_bytes)
    strides = [0] * 5
    cur = 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    buf = torch.empty(cur, dtype=torch.uint8, device="cuda")
    views = [
        torch.as_strided(buf, shape[1:], strides[1:], layer * strides[0]).view(torch.bfloat16)
        for layer in range(layers)
    ]
    return buf, views


@pytest.fixture
def agent(tmp_path: Path):
    from kvtier.testing.processes import Agent, Kvtierd

    if not (os.environ.get("KVTIERD_BIN") and os.environ.get("KVTIERAGENT_BIN")):
        pytest.skip("KVTIERD_BIN and KVTIERAGENT_BIN name the binaries (scripts/gpu-check)")
    d = Kvtierd(tmp_path / "daemon", "l2.pool_bytes=4GiB")
    a = Agent(tmp_path, "agent", d.socket)
    yield a
    a.stop()
    d.stop()


def register(agent, views, blocks: int, tokens: int):
    from kvtier.agent import AgentClient
    from kvtier.integrations.vllm.blocks import block_bytes, cuda_export, pieces
    from kvtier.layout import LayoutSpec, State

    geo = [block_bytes(f"model.layers.{i}.attn", v, blocks) for i, v in enumerate(views)]
    ex = cuda_export(views)
    desc = LayoutSpec(
        model_id="dma-gpu",
        model_version="",
        dtype="uint8",
        num_layers=len(views),
        page_size=tokens,
        shape=State(geo[0].block_bytes // tokens),
    ).descriptor()
    c = AgentClient(agent.socket, timeout=30)
    info = c.register_pool(
        desc,
        blocks * tokens,
        cuda_ordinal=ex.ordinal,
        cuda_ipc_handles=ex.handles,
        allocation_bytes=ex.allocation_bytes,
        pieces=pieces(geo, ex.bases),
        engine_cache=True,
    )
    deadline = time.monotonic() + 20
    while not c.stats().daemon_connected:
        assert time.monotonic() < deadline, "the agent never linked to kvtierd"
        time.sleep(0.05)
    return c, info, geo


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_saved_and_loaded_by_the_agent_come_back_bit_identical(agent, layout) -> None:
    from kvtier.keys import Namespace

    blocks, tokens = 32, 16
    buf, views = vllm_layers(LAYOUTS[layout], 4, blocks, 2, tokens, 64)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    c, info, _ = register(agent, views, blocks, tokens)
    ns = Namespace(tenant=f"dma-{layout}")
    prompt = list(range(1, 3 * tokens + 1))
    src, dst = [5, 2, 7], [1, 3, 30]
    want = [torch.stack([v[b] for b in src]).clone() for v in views]
    saved = c.save_pages(prompt, ns, 0, src, owner=info.owner)
    assert saved.stored == 3, saved
    buf.zero_()
    torch.cuda.synchronize()
    assert c.load_pages(prompt, ns, 0, dst, owner=info.owner).pages == 3
    for v, w in zip(views, want, strict=True):
        got = torch.stack([v[b] for b in dst])
        assert torch.equal(got.view(torch.int16), w.view(torch.int16)), layout
    # Nothing but the loaded blocks was written.
    written = sum(
        int(torch.stack([v[b] for b in dst]).view(torch.uint8).count_nonzero()) for v in views
    )
    assert int(buf.count_nonzero()) == written
    c.close()


def test_dma_saves_and_loads_against_a_pinned_copy(agent) -> None:
    """Timings (printed; the goals live in docs/vllm.md's table): a step's saves of 64 blocks
    of an 8B-shaped layer set, and their loads, against one pinned copy of the same bytes."""
    from kvtier.keys import Namespace

    blocks, tokens, n = 256, 16, 64
    buf, views = vllm_layers(LAYOUTS["LBNHC"], 32, blocks, 8, tokens, 128)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    c, info, geo = register(agent, views, blocks, tokens)
    nbytes = n * sum(g.block_bytes for g in geo)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def med(f, rounds: int = 7) -> float:
        xs = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            xs.append(time.perf_counter() - t)
        return statistics.median(xs)

    base = med(lambda: (pinned.copy_(dev, non_blocking=True), torch.cuda.synchronize()))
    rounds = iter(range(1000))

    def save() -> None:
        r = next(rounds)
        prompt = list(range(r * 100_000 + 1, r * 100_000 + n * tokens + 1))
        s = c.save_pages(prompt, Namespace(tenant="bench"), 0, list(range(n)), owner=info.owner)
        assert s.stored == n, s

    saves = med(save)
    prompt = list(range(1, n * tokens + 1))
    c.save_pages(prompt, Namespace(tenant="load"), 0, list(range(n)), owner=info.owner)
    loads = med(
        lambda: c.load_pages(
            prompt, Namespace(tenant="load"), 0, list(range(n, 2 * n)), owner=info.owner
        )
    )
    print()
    for what, s in (("DMA save, 64 blocks", saves), ("DMA load, 64 blocks", loads)):
        print(
            f"{what:<24} {s * 1e3:8.2f} ms {nbytes / s / 1e9:7.2f} GB/s  "
            f"vs pinned copy {base / s:5.2f}"
        )
    c.close()
