"""Where vLLM 0.33's KV blocks lie, for every layout it can allocate, and what kvtier makes of
them: the canonical byte order of a block (``kvtier.integrations.vllm.blocks``), the pieces the
agent's DMA path copies, and the staging path's pages, which must be the same bytes.

The layer views come from vLLM's own allocation code (``create_kv_cache_views`` over one
backing allocation with the strides ``compute_layout_strides`` gives each ``KVCacheLayout``),
with padded pages and kernel-block splitting where vLLM allows them; nothing here imitates
vLLM's shapes. No GPU is needed: the same arithmetic runs on CPU tensors, and the agent
checks the pieces' map by field before it opens any handle."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.agent import AgentClient
from kvtier.host import KvtierError
from kvtier.integrations.vllm.blocks import block_bytes, pieces, storage_bytes
from kvtier.integrations.vllm.staging import Staging
from kvtier.layout import LayoutSpec, State
from kvtier.testing.fixtures import agent, kvtierd  # noqa: F401, F811 - fixtures

NUM_BLOCKS, LAYERS, BLOCK = 6, 3, 4


def allocate(spec, layout: KVCacheLayout, padded: bool = False, kernel_block: int | None = None):
    """vLLM's per-layer views over one backing allocation, as its allocator builds them."""
    block_stride = None
    if padded:
        block_stride = spec.page_size_bytes * LAYERS + 64  # room vLLM may leave per block
    ls, bs, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    size = max(ls * LAYERS, bs * NUM_BLOCKS) + 4096
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
        layer_stride=ls,
        block_stride=bs,
        offset=128,
    )
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block)
    # Distinct bytes everywhere, so any misplaced byte shows.
    g = torch.Generator().manual_seed(7)
    raw.copy_(torch.randint(-128, 128, (size,), generator=g, dtype=torch.int8))
    return raw, views


MHA = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
MLA = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.bfloat16)

CASES = [
    *[pytest.param(MHA, layout, False, None, id=f"mha-{layout.name}") for layout in KVCacheLayout],
    *[pytest.param(MLA, layout, False, None, id=f"mla-{layout.name}") for layout in KVCacheLayout],
    *[
        pytest.param(MHA, layout, True, None, id=f"mha-{layout.name}-padded")
        for layout in KVCacheLayout
        if layout.is_block_compact
    ],
    *[
        pytest.param(MHA, layout, False, 2, id=f"mha-{layout.name}-kernel-blocks")
        for layout in KVCacheLayout
        # vLLM splits blocks into kernel blocks only where a block is one dense page.
        if layout.is_layer_compact and layout.is_block_contiguous
    ],
]


@pytest.mark.parametrize(("spec", "layout", "padded", "kernel_block"), CASES)
def test_pieces_and_staging_move_the_same_bytes_for_every_vllm_layout(
    spec, layout, padded, kernel_block
) -> None:
    raw, views = allocate(spec, layout, padded, kernel_block)
    geo = [block_bytes(f"l{i}", v, NUM_BLOCKS) for i, v in enumerate(views)]
    page_bytes = sum(x.block_bytes for x in geo)
    assert len({x.form for x in geo}) == 1
    # A block holds exactly the bytes of the layer's view of it, in some order.
    axis_blocks = [
        v.unflatten(0, (NUM_BLOCKS, -1)) if v.shape[0] != NUM_BLOCKS else v for v in views
    ]
    for x, v in zip(geo, axis_blocks, strict=True):
        logical = v[3].contiguous().view(torch.uint8).reshape(-1)
        assert x.block_bytes == logical.numel()
    mem = storage_bytes(views[0])
    # The agent's pieces: one allocation, vLLM's tensors at their offsets in it.
    ps = pieces(geo, [(0, 0)] * LAYERS)
    assert sum(p.length for p in ps) == page_bytes
    if layout.is_block_contiguous:
        # A block of a layer is one span: never more pieces than layers.
        assert len(ps) <= LAYERS
    if layout.is_block_outermost and layout.is_block_compact and not padded:
        assert len(ps) == 1, ps  # all layers of a block together: a page is one copy

    def through_pieces(m: torch.Tensor, b: int) -> torch.Tensor:
        return torch.cat([m[p.offset + b * p.page_stride :][: p.length] for p in ps])

    st = Staging(LAYERS, 4, geo[0].block_bytes)
    try:
        canon = [x.view(storage_bytes(v)) for x, v in zip(geo, views, strict=True)]
        blocks, slots, dsts = [5, 0, 3], [2, 0, 1], [1, 2, 4]
        for b, s in zip(blocks, slots, strict=True):
            st.from_blocks(canon, [b], [s])
            staged = st.view[:, s].reshape(-1)
            assert torch.equal(staged, through_pieces(mem, b)), f"block {b}"
            # And the page is the layers' blocks: each layer's bytes are that layer's block.
            for i, v in enumerate(axis_blocks):
                want = torch.sort(v[b].contiguous().view(torch.uint8).reshape(-1)).values
                got = torch.sort(st.view[i, s]).values
                assert torch.equal(got, want), (b, i)
        # Loading puts the staged bytes where the pieces say and touches nothing else.
        before = mem.clone()
        st.to_blocks(canon, slots, dsts)
        for dst, src in zip(dsts, blocks, strict=True):
            assert torch.equal(through_pieces(mem, dst), through_pieces(before, src)), dst
        written = {
            p.offset + b * p.page_stride + k for p in ps for b in dsts for k in range(p.length)
        }
        changed = (mem != before).nonzero().reshape(-1).tolist()
        assert set(changed) <= written
        # A block id outside the KV cache is an error before anything moves, either way.
        pages, blocks_before = st.view.clone(), mem.clone()
        with pytest.raises(IndexError, match="outside the KV cache"):
            st.from_blocks(canon, [1, NUM_BLOCKS], [0, 1])
        with pytest.raises(IndexError, match="outside the KV cache"):
            st.to_blocks(canon, [0, 1], [-1, 2])
        assert torch.equal(st.view, pages) and torch.equal(mem, blocks_before)
    finally:
        st.close()


def test_pieces_pass_the_agents_map_checks(agent) -> None:  # noqa: F811 - the fixture
    """The pieces of a vLLM layout registered as a CUDA pool: the agent accepts the map (on
    a machine without a GPU it then says the driver is missing; with one, that the zero
    handle is not a handle), and refuses a map that names more bytes than the allocation
    holds, naming the piece."""
    raw, views = allocate(MHA, KVCacheLayout.LBNHC)
    geo = [block_bytes(f"l{i}", v, NUM_BLOCKS) for i, v in enumerate(views)]
    ps = pieces(geo, [(0, 0)] * LAYERS)
    desc = LayoutSpec(
        model_id="vllm-blocks",
        model_version="",
        dtype="uint8",
        num_layers=LAYERS,
        page_size=BLOCK,
        shape=State(geo[0].block_bytes // BLOCK),
    ).descriptor()
    c = AgentClient(agent.socket)
    try:
        end = max(p.offset + (NUM_BLOCKS - 1) * p.page_stride + p.length for p in ps)

        def register(allocation_bytes: int):
            return c.register_pool(
                desc,
                NUM_BLOCKS * BLOCK,
                cuda_ordinal=0,
                cuda_ipc_handles=[bytes(64)],
                allocation_bytes=[allocation_bytes],
                pieces=ps,
                engine_cache=True,
            )

        with pytest.raises(KvtierError) as e:
            register(raw.numel())
        assert not e.value.invalid_input, str(e.value)
        assert "libcuda" in str(e.value) or "ipc_handles[0]" in str(e.value), str(e.value)
        with pytest.raises(KvtierError) as e:
            register(end - 1)
        assert e.value.invalid_input
        assert "cuda.pieces[" in str(e.value), str(e.value)
    finally:
        c.close()


def test_the_ipc_handle_is_read_out_of_every_framing_torch_uses():
    """torch frames a storage's handle as [version][b"c"][64 bytes] (version 2 up to 2.12, 3
    since 2.13); the agent takes the 64 bytes. Found on an H200: the framed 66 bytes reached
    the agent, which refused them, and every DMA registration fell back to staging."""
    from kvtier.integrations.vllm.blocks import CUDA_IPC_HANDLE_BYTES, ipc_mem_handle
    from kvtier.integrations.vllm.common import choose_transfer

    raw = bytes(range(7, 7 + CUDA_IPC_HANDLE_BYTES))
    for version in (2, 3):
        assert ipc_mem_handle(bytes([version]) + b"c" + raw) == raw
    assert ipc_mem_handle(raw) == raw, "a bare handle (older torch) passes unchanged"
    with pytest.raises(ValueError, match="expandable segment"):
        ipc_mem_handle(b"\x03e" + b"\0" * 40)
    for bad in (b"", b"\x03", b"\x03c" + raw[:63], b"\x03x" + raw, raw + b"\0"):
        with pytest.raises(ValueError, match="64-byte handle"):
            ipc_mem_handle(bad)

    # What the worker makes of an export that fails that way: staging under auto, with the
    # reason; an error naming the setting under dma.
    def export() -> None:
        ipc_mem_handle(b"\x03e" + b"\0" * 40)

    dma, why = choose_transfer("auto", "cuda:0", True, export)
    assert not dma and why is not None and "expandable segment" in why
    with pytest.raises(ValueError, match="transfer: dma: cannot export"):
        choose_transfer("dma", "cuda:0", True, export)


def test_a_cpu_kv_cache_in_shared_memory_exports_as_files_whose_pieces_are_its_blocks():
    """The CPU stand-in for DMA: each layer's storage exported as the file torch shares it
    by; reading a block's pieces from those files gives the block's bytes in the order the
    staging path copies them (so a page saved one way loads bit-identical the other)."""
    import os

    import torch

    from kvtier.integrations.vllm.blocks import (
        block_bytes,
        cpu_export,
        in_shared_memory,
        pieces,
        storage_bytes,
    )

    blocks = 6
    layers = [torch.randn(blocks, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3)]
    assert not in_shared_memory(layers)
    with pytest.raises(ValueError, match="not in CPU shared memory"):
        cpu_export(layers)
    for t in layers:
        t.share_memory_()
    assert in_shared_memory(layers)
    geometry = [block_bytes(f"l{i}", t, blocks) for i, t in enumerate(layers)]
    ex = cpu_export(layers)
    # The descriptors torch keeps for the storages, one per storage.
    assert len(ex.fds) == 3 and all(os.path.isfile(f"/proc/self/fd/{fd}") for fd in ex.fds)
    ps = pieces(geometry, ex.bases)
    views = [g.view(storage_bytes(t)) for g, t in zip(geometry, layers, strict=True)]
    for b in range(blocks):
        want = b"".join(v[b].contiguous().numpy().tobytes() for v in views)
        got = b""
        for p in ps:
            got += os.pread(ex.fds[p.allocation], p.length, p.offset + b * p.page_stride)
        assert got == want, f"block {b}"
    for fd, size in zip(ex.fds, ex.allocation_bytes, strict=True):
        assert os.fstat(fd).st_size >= size
    # Review finding: under torch's file_system strategy, sharing by descriptor moves the
    # storage (views taken before would point at freed memory): refused.
    import torch.multiprocessing as mp

    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        moved = torch.zeros(4, 64).share_memory_()
        with pytest.raises(ValueError, match="moved it"):
            cpu_export([moved])
    finally:
        mp.set_sharing_strategy(strategy)
