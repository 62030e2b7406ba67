"""The vLLM connector's staging pool: blocks copy into staging pages and back byte for byte,
whether the pages are one run, several, or scattered, for layers whose block is one span of
memory and for layers with a K/V axis before the block axis (a block in two spans), each
page holding the block's spans in order (what the agent's DMA moves), and, where there is
a GPU (``scripts/gpu-check`` runs this file there), for CUDA layers through the pinned pool
with asynchronous copies and an event."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.vllm.blocks import block_bytes, storage_bytes
from kvtier.integrations.vllm.staging import Staging, _runs


def test_runs_split_slots_into_consecutive_pieces() -> None:
    assert _runs([]) == []
    assert _runs([3, 4, 5]) == [(3, 0, 3)]
    assert _runs([7, 8, 2, 3, 9]) == [(7, 0, 2), (2, 2, 2), (9, 4, 1)]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [5, 6, 0, 1], [7, 2, 4, 0]])
@pytest.mark.parametrize("block_first", [True, False])
def test_blocks_round_trip_through_staging(
    slots: list[int], block_first: bool, device: str
) -> None:
    blocks, heads, bs, head = 12, 2, 4, 8
    g = torch.Generator().manual_seed(len(slots) + 10 * block_first)

    def layer() -> torch.Tensor:
        raw = torch.randint(-30000, 30000, (blocks, heads, bs, 2 * head), generator=g)
        t = raw.to(torch.int16).view(torch.bfloat16)
        # A K/V axis before the block axis: a block is two spans of memory.
        if not block_first:
            t = t.view(blocks, heads, bs, 2, head).permute(3, 0, 1, 2, 4).contiguous()
        return t.to(device)

    layers = [layer() for _ in range(3)]
    geo = [block_bytes(f"l{i}", t, blocks) for i, t in enumerate(layers)]
    assert all(len(x.spans()) == (1 if block_first else 2) for x in geo)
    views = [x.view(storage_bytes(t)) for x, t in zip(geo, layers, strict=True)]
    block_size = heads * bs * 2 * head * 2
    assert all(x.block_bytes == block_size for x in geo)
    # A memfd, as the connector makes it (CUDA page-locks shared memory on a GPU).
    st = Staging(len(layers), 8, block_size)
    try:
        if device == "cuda":
            assert st.pin(), "CUDA refused to page-lock the staging pool"
        src, dst = [1, 9, 4, 6], [0, 2, 11, 5]
        before = [t.clone() for t in layers]
        # A page holds each layer's block as its spans of memory, in order.
        want = [
            [
                torch.cat([storage_bytes(t)[x.origin + b * x.block_stride + o :][:n]
                           for o, n in x.spans()]).cpu()
                for b in src
            ]
            for x, t in zip(geo, layers, strict=True)
        ]  # fmt: skip
        ready = st.from_blocks(views, src, slots)
        if device == "cuda":
            # The copies are asynchronous: whoever reads the pages waits for this event.
            assert ready is not None
            ready.synchronize()
        else:
            assert ready is None
        # Overwritten at once, as vLLM may reuse the blocks: the pages hold what was copied.
        for t in layers:
            t.zero_()
        for i in range(len(layers)):
            for j, s in enumerate(slots):
                assert torch.equal(st.view[i, s], want[i][j]), (i, s)
        st.to_blocks(views, slots, dst)
        axis = 0 if block_first else 1
        for t, b in zip(layers, before, strict=True):
            got = t.index_select(axis, torch.tensor(dst, device=t.device))
            exp = b.index_select(axis, torch.tensor(src, device=b.device))
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
            # Nothing but the loaded blocks was written.
            assert int(t.view(torch.int16).count_nonzero()) == int(
                got.view(torch.int16).count_nonzero()
            )
    finally:
        st.close()


_TOO_BIG = """
import resource, sys
from kvtier.integrations.vllm.staging import Staging
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    Staging(2, 1024, 2048)
except ValueError as e:
    print(e)
    sys.exit(3)
"""


def test_a_staging_pool_that_does_not_fit_is_a_clear_error_not_a_sigbus() -> None:
    """Memory the worker cannot have for its staging pool (here a file-size limit of 1 MiB
    for 4 MiB: the memfd cannot grow; in production, a memory limit its fallocate meets) is
    a ValueError naming the size and the setting to lower, not a SIGBUS on the first save
    (and not SIGXFSZ: Python ignores it)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _TOO_BIG], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "4194304 bytes" in r.stdout and "staging_pages" in r.stdout, r.stdout
