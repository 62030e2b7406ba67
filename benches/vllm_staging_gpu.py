"""The vLLM connector's staging copies on a GPU, against pinned copies of the same bytes
(``scripts/gpu-check`` runs this where there is a CUDA GPU; torch only, no vLLM needed).

For a step that saves N blocks of an 8B-shaped model (32 layers, 64 KiB per block per
layer, vLLM's CUDA layout with the block dimension first), it times:

- **step-thread time**: what ``Staging.from_blocks`` costs the step's thread (it enqueues a
  device gather and an asynchronous copy into the pinned pool per layer, and records an
  event; no host sync);
- **until landed**: from the call to its event completing;
- **baseline**: one pinned device-to-host copy of the same bytes from a contiguous device
  buffer (``copy_(non_blocking=True)`` + sync), in the same run;
- **old path**: the synchronous gather it replaced (index_select, ``.cpu()``, index_copy_).

Loads (``to_blocks``: pinned host-to-device copies and a device scatter) likewise.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtier.integrations.vllm.blocks import block_bytes, storage_bytes
from kvtier.integrations.vllm.staging import Staging

LAYERS, BLOCK, HEADS, HEAD = 32, 16, 8, 128


def med(f, rounds: int = 20) -> float:
    f()
    torch.cuda.synchronize()
    xs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def measure(n: int, layers: list[torch.Tensor]) -> None:
    """One step's copies of ``n`` blocks, printed as rows."""
    dev, blocks = layers[0].device, layers[0].shape[0]
    views = [block_bytes("l", t, blocks).view(storage_bytes(t)) for t in layers]
    per_block = BLOCK * HEADS * HEAD * 2
    st = Staging(LAYERS, 256, per_block)
    assert st.pin(), "CUDA refused to page-lock the staging pool"
    nbytes = n * per_block * LAYERS
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    ids = torch.randperm(blocks)[:n].tolist()
    slots = list(range(n))
    base = med(lambda: (pinned.copy_(src, non_blocking=True), torch.cuda.synchronize()))
    enqueue = med(lambda: st.from_blocks(views, ids, slots))

    def landed():
        ev = st.from_blocks(views, ids, slots)
        assert ev is not None
        ev.synchronize()

    full = med(landed)

    def old():
        idx = torch.tensor(ids, device=dev)
        dst = torch.tensor(slots)
        for i, t in enumerate(layers):
            g = t.index_select(0, idx).contiguous().view(torch.uint8).reshape(n, -1).cpu()
            st.view[i].index_copy_(0, dst, g)

    was = med(old, 5)
    load = med(lambda: st.to_blocks(views, slots, ids))
    load_base = med(lambda: (src.copy_(pinned, non_blocking=True), torch.cuda.synchronize()))
    for what, s, b in (
        ("save: step-thread time", enqueue, base),
        ("save: until landed", full, base),
        ("save: old synchronous path", was, base),
        ("pinned D2H copy (baseline)", base, base),
        ("load: to_blocks", load, load_base),
        ("pinned H2D copy (baseline)", load_base, load_base),
    ):
        print(f"{n:>5} {what:<28} {s * 1e3:>8.3f} {nbytes / s / 1e9:>7.2f} {b / s:>14.2f}")
    st.close()


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing measured")
        return
    dev = torch.device("cuda")
    shape = (4096, BLOCK, HEADS, HEAD)
    layers = [torch.randn(*shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    print(f"{'pages':>5} {'what':<28} {'ms':>8} {'GB/s':>7} {'vs pinned copy':>14}")
    for n in (16, 128):
        measure(n, layers)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
