"""The vLLM connector's staging pool: blocks copy into staging pages and back byte for byte,
whether the pages are one run, several, or scattered, for contiguous CPU layers (one copy per
run), for layers whose block dimension is not first (the general path), and, where there is
a GPU (``scripts/gpu-check`` runs this file there), for CUDA layers through the pinned pool
with asynchronous copies and an event."""

from __future__ import annotations

import pytest
import torch

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
    tmp_path, slots: list[int], block_first: bool, device: str
) -> None:
    blocks, heads, bs, head = 12, 2, 4, 8
    g = torch.Generator().manual_seed(len(slots) + 10 * block_first)

    def layer() -> torch.Tensor:
        raw = torch.randint(-30000, 30000, (blocks, heads, bs, 2 * head), generator=g)
        t = raw.to(torch.int16).view(torch.bfloat16)
        # Block dimension second (a K/V dimension first) is a view that is not contiguous.
        t = t if block_first else t.movedim(0, 1).contiguous().movedim(1, 0)
        return t.to(device)

    layers = [layer() for _ in range(3)]
    block_bytes = heads * bs * 2 * head * 2
    # On a GPU, in /dev/shm as the connector puts it (CUDA page-locks shared memory).
    st = Staging(len(layers), 8, block_bytes, "" if device == "cuda" else str(tmp_path))
    try:
        if device == "cuda":
            assert st.pin(), "CUDA refused to page-lock the staging pool"
        src, dst = [1, 9, 4, 6], [0, 2, 11, 5]
        before = [t[src].clone() for t in layers]
        ready = st.from_blocks(layers, src, slots)
        if device == "cuda":
            # The copies are asynchronous: whoever reads the pages waits for this event.
            assert ready is not None
            ready.synchronize()
        else:
            assert ready is None
        # Overwritten at once, as vLLM may reuse the blocks: the pages hold what was copied.
        for t in layers:
            t[src] = torch.zeros_like(t[src])
            t[dst] = torch.zeros_like(t[dst])
        for i in range(len(layers)):
            for j, s in enumerate(slots):
                want = before[i][j].contiguous().view(torch.uint8).reshape(-1).cpu()
                assert torch.equal(st.view[i, s], want), (i, s)
        st.to_blocks(layers, slots, dst)
        for t, want in zip(layers, before, strict=True):
            assert torch.equal(t[dst].view(torch.int16), want.view(torch.int16))
    finally:
        st.close()
