"""The staging pool a vLLM worker copies through: a memfd the worker hands the agent as a
descriptor, which the agent maps as its cpu device. A block moves between vLLM's tensor and a
staging page here, and between the staging page and L2 in the agent."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvtier._memory_door import memfd


class Slots:
    """The free pages of a staging pool, shared by the step's thread (saves) and the
    connector's I/O threads (loads; saves return their pages when the agent is done)."""

    def __init__(self, pages: int):
        self._free = list(range(pages))
        self._total = pages
        self._cv = threading.Condition()

    def take(self, most: int, wait: float = 0.0) -> list[int]:
        """Up to ``most`` free pages; waits up to ``wait`` seconds for the first."""
        with self._cv:
            if wait > 0 and not self._free:
                self._cv.wait_for(lambda: bool(self._free), timeout=wait)
            n = min(most, len(self._free))
            out, self._free[:n] = self._free[:n], []
            return out

    def give(self, pages: Sequence[int]) -> bool:
        """Returns pages; True when every page is free again."""
        with self._cv:
            self._free.extend(pages)
            self._cv.notify_all()
            return len(self._free) == self._total


class Staging:
    """The staging pool: a memfd (no name in any directory, so nothing to plant, find or
    leave behind) the agent maps as its cpu device, one buffer per layer, page p of layer l
    at ``(l * pages + p) * block_bytes``. Its space is allocated up front (posix_fallocate):
    memory too short for it is an error here, naming the size, not a SIGBUS on the first
    save. The agent seals it against shrinking when it maps it."""

    def __init__(self, layers: int, pages: int, block_bytes: int):
        self.layers, self.pages, self.block_bytes = layers, pages, block_bytes
        size = layers * pages * block_bytes
        try:
            self.fd = memfd("kvtier-vllm-staging", size)
        except OSError as e:
            raise self._too_big(size, e) from None
        try:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:
                raise self._too_big(size, e) from None
            # Mapped in up front (MAP_POPULATE), so the step's copies never fault pages in.
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = torch.frombuffer(self._map, dtype=torch.uint8).view(layers, pages, block_bytes)
        self.slots = Slots(pages)
        # Retired after a call that may have left the agent copying in it: never written
        # again, closed once every page taken from it is back.
        self.retired = False
        self._closed = False
        # The owner token of its registration with the agent (set when registered).
        self.owner = ""
        # Registered with CUDA (page-locked), so device copies are asynchronous DMA.
        self.pinned = False
        # The views last copied from, as numpy arrays (_host_arrays).
        self._arrays: tuple[Sequence[torch.Tensor], list[np.ndarray], np.ndarray] | None = None

    def _too_big(self, size: int, e: OSError) -> ValueError:
        return ValueError(
            f"kvtier: the staging pool needs {size} bytes ({self.pages} pages of "
            f"{self.block_bytes} bytes in {self.layers} layers) of shared memory, which could "
            f"not be allocated ({e.strerror}); lower kv_connector_extra_config.staging_pages, "
            "or give the worker more memory"
        )

    def pin(self) -> bool:
        """Registers the pool with CUDA (page-locked), for workers whose KV is on a GPU: its
        device-host copies are then DMA that needs no host sync. False where that is refused
        (memlock limits): copies still work, synchronously."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        rt = torch.cuda.cudart()
        if rt is None:
            return False
        r = rt.cudaHostRegister(self.view.data_ptr(), self.view.numel(), 0)
        self.pinned = int(getattr(r, "value", r)) == 0
        return self.pinned

    def take(self, most: int, wait: float = 0.0) -> list[int]:
        """Free pages to copy through (none from a retired pool)."""
        return [] if self.retired else self.slots.take(most, wait)

    def give(self, pages: Sequence[int]) -> None:
        """Pages done with; a retired pool closes when it has them all back."""
        if self.slots.give(pages) and self.retired:
            self.close()

    def retire(self) -> None:
        self.retired = True
        if self.slots.give(()):
            self.close()

    def from_blocks(
        self, views: Sequence[torch.Tensor], blocks: list[int], slots: list[int]
    ) -> torch.cuda.Event | None:
        """Copies vLLM blocks into staging pages. ``views`` are the layers' canonical block
        views (:meth:`kvtier.integrations.vllm.blocks.BlockBytes.view`: block ``b`` is its
        bytes in kvtier's order, whatever vLLM's layout). On CPU: one gather per layer and
        run of consecutive staging pages (usually one), straight into the pages. On a GPU: a
        gather on the device and an asynchronous copy into the (pinned) pages per layer and
        run, all on the current stream, with no host sync; returns the event after the last
        copy, which whoever reads the pages waits for (the blocks may be reused at once:
        later work on the stream runs after the gather)."""
        dev = views[0].device
        if dev.type == "cpu":
            # numpy's take: one memmove per block on this thread, the GIL released once per
            # layer. torch's index_select spreads each layer's copy over its OpenMP pool,
            # whose wake-ups cost more than the copy beside a busy engine (measured: 4-5x
            # slower per page in the vLLM bench, docs/BENCHMARKS.md).
            # mode="clip" writes straight into the pages ("raise" buffers a copy); the block
            # ids are checked first (_host_runs).
            for v, page, idx in self._host_runs(views, blocks, slots):
                v.take(idx, axis=0, out=page, mode="clip")
            return None
        for s0, b0, n in _runs(slots):
            idx = torch.tensor(blocks[b0 : b0 + n], dtype=torch.long, device=dev)
            for i, v in enumerate(views):
                page = self.view[i, s0 : s0 + n]
                page.copy_(v.index_select(0, idx).view(n, -1), non_blocking=True)
        if dev.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _host_runs(
        self, views: Sequence[torch.Tensor], blocks: list[int], slots: list[int]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """For host-memory views: (a layer's blocks, that layer's run of staging pages, the
        run's block ids) per layer and run of consecutive pages. A block id outside the KV
        cache is an error before anything is copied, never a page."""
        layers, pages = self._host_arrays(views)
        if blocks and (min(blocks) < 0 or max(blocks) >= len(layers[0])):
            raise IndexError(f"kvtier: block ids {blocks} outside the KV cache")
        for s0, b0, n in _runs(slots):
            idx = np.asarray(blocks[b0 : b0 + n], dtype=np.intp)
            for i, v in enumerate(layers):
                yield v, pages[i, s0 : s0 + n], idx

    def _host_arrays(self, views: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], np.ndarray]:
        """numpy arrays over host-memory block views and over this pool's pages shaped like
        one layer's blocks, made once per list of views (a worker passes the same one)."""
        cached = self._arrays
        if cached is None or cached[0] is not views:
            layers = [v.numpy() for v in views]
            pages = self.view.numpy().reshape(self.layers, self.pages, *layers[0].shape[1:])
            cached = self._arrays = (views, layers, pages)
        return cached[1], cached[2]

    def to_blocks(self, views: Sequence[torch.Tensor], slots: list[int], blocks: list[int]):
        """Copies staging pages into vLLM blocks through their canonical views. On CPU: one
        scatter per layer and run of consecutive staging pages, straight from the pages. On
        a GPU: an asynchronous copy per layer and run and a scatter on the device, on the
        current stream; returns once the copies have read the pages (they may be reused
        then)."""
        dev = views[0].device
        if dev.type == "cpu":
            # numpy, for the reason from_blocks gives.
            for v, page, idx in self._host_runs(views, blocks, slots):
                v[idx] = page
            return
        for s0, b0, n in _runs(slots):
            idx = torch.tensor(blocks[b0 : b0 + n], dtype=torch.long, device=dev)
            for i, v in enumerate(views):
                page = self.view[i, s0 : s0 + n].to(dev, non_blocking=True)
                v.index_copy_(0, idx, page.view(n, *v.shape[1:]))
        if dev.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rt = torch.cuda.cudart() if self.pinned else None
        if rt is not None:
            rt.cudaHostUnregister(self.view.data_ptr())
        self.pinned = False
        self._arrays = None
        del self.view
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive pages: (first page, index in ``slots``, length)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((slots[i], i, j - i))
        i = j
    return out
