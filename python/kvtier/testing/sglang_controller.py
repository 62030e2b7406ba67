"""One SGLang worker's HiCache storage path, in ``cache`` or ``buffer_only`` host memory mode,
with kvtier as its ``dynamic`` storage backend (for tests/sglang/test_sglang_buffer_only.py
and benches/sglang_buffer_only.py; run as a script it is one worker process of the tests).

What is SGLang's own: the device pool, the host pool (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``, sized by ``host_to_device_ratio`` as SGLang sizes it), the
``HiCacheController`` built with ``host_memory_mode`` and ``storage_backend="dynamic"`` (which
loads ``kvtier.sglang.KvtierStorage`` through SGLang's factory), its backup thread
(``write_storage`` → ``batch_set_v1``), its prefetch I/O and sync threads (``prefetch_buffer``
→ ``batch_get_v1`` → ``ack_prefetch_queue``) and its host-buffer allocation.

What this file does in SGLang's place, on the CPU (no GPU here):
- the device → host copy that fills a staging slot (SGLang's copy kernels exist only for
  CUDA, ROCm and XPU; ``transfer_kv_*`` are not even defined on a CPU-only install): the page
  bytes are written into the staged host slots directly;
- the prefetch hit query's key computation (SGLang hashes tokens with a C++ extension it
  compiles with ninja at first use; not installed here): keys are given, and the hit count
  is the backend's ``batch_exists`` over them, as ``_storage_hit_query`` asks it;
- the scheduler thread's part of UnifiedRadixCache's buffer pipeline: stage a write, free
  the staging at the storage ack (``buffer_only``) or keep it as the host cache (``cache``);
  allocate a prefetch bounce sized to the hit, free it once read.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_parallel

from kvtier.testing.sglang import LAYERS, PAGE, Worker, keys

# SGLang's default host/device ratios (arg_groups/hicache_hook.py,
# handle_hicache_ratio_default): 2.0 in cache mode, 1.2 in buffer_only mode.
DEFAULT_RATIO = {"cache": 2.0, "buffer_only": 1.2}
POISON = 0xA5


@contextmanager
def single_rank():
    """SGLang's parallel context for one rank with no process groups, as its own unit
    fixtures state it (the controller reads TP, PP and DCP ranks from it)."""
    with get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    ):
        yield


def page_bytes(key: str, size: int) -> torch.Tensor:
    """A page's bytes in kvtier's canonical order, a function of its key only: random, and
    different for every key, so a misplaced or foreign page is seen."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)


@dataclass
class Counts:
    """What a worker's storage path did, by outcome."""

    written: int = 0
    given_up: dict[str, int] = field(default_factory=dict)
    loaded: int = 0
    peak_host_pages: int = 0


class Node:
    """One worker: SGLang's device and host pools and HiCacheController, in ``mode``."""

    def __init__(
        self,
        socket: str,
        mode: str,
        layout: str = "page_first_direct",
        mla: bool = False,
        device_pages: int = 32,
        ratio: float | None = None,
        model: str = "test/model",
        **settings,
    ):
        self.mode, self.layout, self.mla = mode, layout, mla
        tokens = device_pages * PAGE
        if mla:
            dev = MLATokenToKVPool(
                tokens,
                PAGE,
                torch.bfloat16,
                32,
                16,
                LAYERS,
                "cpu",
                False,
                start_layer=0,
                end_layer=LAYERS - 1,
            )
            make, extra = MLATokenToKVPoolHost, {"target_layer_num": LAYERS}
        else:
            dev = MHATokenToKVPool(
                tokens,
                PAGE,
                torch.bfloat16,
                2,
                64,
                LAYERS,
                "cpu",
                False,
                start_layer=0,
                end_layer=LAYERS - 1,
            )
            make, extra = MHATokenToKVPoolHost, cast(dict[str, Any], {})
        # SGLang's pool assembler builds the host pool with pin_memory=True, which registers
        # it with CUDA; on the CPU it must be False (the only argument changed).
        self.host = make(
            cast(Any, dev.get_device_pool_infos()[0].buffer_info),
            DEFAULT_RATIO[mode] if ratio is None else ratio,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=dev.size,
            start_layer=0,
            end_layer=LAYERS - 1,
            **cast(dict[str, Any], extra),
        )
        allocator = TokenToKVPoolAllocator(
            size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=dev, need_sort=False
        )
        config = {
            "backend_name": "kvtier",
            "module_path": "kvtier.sglang",
            "class_name": "KvtierStorage",
            "interface_v1": 1,
            "socket": socket,
            **settings,
        }
        self.cc = HiCacheController(
            allocator,
            self.host,
            PAGE,
            cast(Any, None),  # no process group: one rank
            threading.Event(),
            write_policy="write_through",
            # What SGLang resolves for the layout (page_first needs the kernel backend).
            io_backend="kernel" if layout == "page_first" else "direct",
            storage_backend="dynamic",
            prefetch_threshold=PAGE,
            model_name=model,
            storage_backend_extra_config=config,
            host_memory_mode=mode,
        )
        backend = self.cc.storage_backend
        assert backend is not None, "SGLang built no storage backend"
        # The backend SGLang loaded: kvtier's KvtierStorage.
        self.backend: Any = backend
        self.worker = Worker(self.host, backend, layout, mla)
        self.page_size = self.worker.canonical(0).numel()
        self.counts = Counts()
        self._rid = 0
        # cache mode: key -> host page index of the pages the host pool keeps (its cache).
        self.resident: dict[str, int] = {}

    @property
    def host_bytes(self) -> int:
        """The host pool's buffer: what this worker holds in host memory for HiCache."""
        return self.worker.kv.numel() * self.worker.kv.element_size()

    def _in_use(self) -> None:
        used = (self.host.size - self.host.available_size()) // PAGE
        self.counts.peak_host_pages = max(self.counts.peak_host_pages, used)

    def close(self) -> None:
        self.cc._stop_storage_threads()
        self.backend.close()

    def poison(self, pages: list[int] | None = None) -> None:
        """Overwrites host pages (all of them by default) with a pattern no page holds."""
        kv = self.worker.kv.view(torch.uint8)
        if pages is None:
            kv.fill_(POISON)
            return
        junk = torch.full((self.page_size,), POISON, dtype=torch.uint8)
        for p in pages:
            self.worker.put_canonical(p, junk)

    # -- write path ---------------------------------------------------------------------

    def stage(self, ks: list[str]) -> torch.Tensor | None:
        """Host slots for ``ks`` holding their bytes (SGLang's D2H into staging), or None
        when the host buffer has no room for them now."""
        idx = self.host.alloc(len(ks) * PAGE)
        if idx is None:
            return None
        for i, k in enumerate(ks):
            self.worker.put_canonical(int(idx[i * PAGE]) // PAGE, page_bytes(k, self.page_size))
        self._in_use()
        return idx

    def submit(self, ks: list[str], idx: torch.Tensor) -> int:
        """Hands staged pages to SGLang's backup thread (``write_storage``)."""
        return self.cc.write_storage(idx, list(range(len(ks) * PAGE)), hash_value=list(ks))

    def acked(self, op, ks: list[str], timeout: float = 60.0) -> None:
        """Takes one storage ack off SGLang's queue (``op``'s) and does what the mode does
        with its staging: ``buffer_only`` frees (and poisons) it, ``cache`` keeps the pages
        as host-resident."""
        acks = self.cc.ack_backup_queue
        assert acks is not None, "SGLang made no backup ack queue (no storage backend)"
        ack = acks.get(timeout=timeout)
        assert ack.id == op, (ack.id, op)
        done = ack.completed_tokens // PAGE
        self.counts.written += done
        if done < len(ks):
            backend = self.backend
            reasons = {
                k: v
                for k, v in getattr(backend, "counters", {}).items()
                if k.startswith(("set_", "error:"))
            } or {"unknown": 1}
            why = ",".join(f"{k}={v}" for k, v in sorted(reasons.items()))
            self.counts.given_up[why] = self.counts.given_up.get(why, 0) + len(ks) - done
        staged = ack.host_indices
        assert staged is not None, "an ack without its host indices"
        pages = [int(staged[i * PAGE]) // PAGE for i in range(len(ks))]
        if self.mode == "buffer_only":
            self.cc.mem_pool_host.free(staged)
            self.poison(pages)
        else:
            for k, p in zip(ks, pages):
                self.keep(k, p)

    def keep(self, key: str, page: int) -> None:
        """cache mode: ``key``'s page stays in the host pool at ``page`` (a copy it held
        before is freed)."""
        old = self.resident.pop(key, None)
        if old is not None:
            self.host.free(torch.arange(old * PAGE, (old + 1) * PAGE, dtype=torch.int64))
        self.resident[key] = page

    def backup(self, ks: list[str], batch: int = 8) -> None:
        """Writes ``ks`` through SGLang's backup thread, ``batch`` pages per operation, with
        as many operations in flight as the host buffer has room to stage (a burst larger
        than the buffer waits for storage acks to free staging, as SGLang's buffer pipeline
        admission does)."""
        inflight: list[tuple[int, list[str]]] = []
        for i in range(0, len(ks), batch):
            part = ks[i : i + batch]
            idx = self.stage(part)
            while idx is None:
                assert inflight, f"the host buffer cannot stage {len(part)} pages at all"
                op, done = inflight.pop(0)
                self.acked(op, done)
                idx = self.stage(part)
            inflight.append((self.submit(part, idx), part))
        for op, done in inflight:
            self.acked(op, done)

    # -- read path ----------------------------------------------------------------------

    def hit(self, ks: list[str]) -> int:
        """The leading pages storage holds (the controller's hit query asks the backend's
        ``batch_exists``)."""
        return self.backend.batch_exists(ks)

    def prefetch(self, ks: list[str], timeout: float = 60.0) -> tuple[int, torch.Tensor | None]:
        """Loads the leading ``ks`` storage holds into a host bounce through SGLang's
        prefetch I/O thread: (pages loaded, their host indices)."""
        n = self.hit(ks)
        if n == 0:
            return 0, None
        self._rid += 1
        op = PrefetchOperation(f"r{self._rid}", list(range(n * PAGE)))
        idx = self.cc.alloc_prefetch_host_buffers(op, n * PAGE)
        assert idx is not None, f"no host room for a {n}-page prefetch bounce"
        self._in_use()
        op.hash_value, op.host_indices, op.storage_hit_count = list(ks[:n]), idx, n * PAGE
        queue = self.cc.prefetch_buffer
        assert queue is not None, "SGLang made no prefetch queue (no storage backend)"
        queue.put(op)
        done = 0
        deadline = time.monotonic() + timeout
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert ack.rid == op.request_id, (ack.rid, op.request_id)
            if ack.completed_tokens is not None:
                done = ack.completed_tokens // PAGE
            if ack.completed_req:
                break
        self.counts.loaded += done
        return done, idx

    def read(self, idx: torch.Tensor, n: int) -> list[torch.Tensor]:
        """The canonical bytes of the first ``n`` pages at host indices ``idx``."""
        return [self.worker.canonical(int(idx[i * PAGE]) // PAGE) for i in range(n)]

    def release(self, idx: torch.Tensor | None) -> None:
        """Frees a prefetch bounce once read (the H2D ack, in SGLang)."""
        if idx is not None:
            self.cc.mem_pool_host.free(idx)

    def wrong_pages(self, ks: list[str], idx: torch.Tensor, n: int) -> list[int]:
        """The pages among the first ``n`` loaded whose bytes are not their key's."""
        got = self.read(idx, n)
        return [i for i in range(n) if not torch.equal(got[i], page_bytes(ks[i], self.page_size))]


def main() -> None:
    """One worker process: ``write`` or ``read`` ``n`` pages of chain ``salt``."""
    socket, role, mode, layout, salt, n = sys.argv[1:7]
    ks = keys(int(n), salt=salt)
    with single_rank():
        node = Node(socket, mode, layout)
        try:
            if role == "write":
                node.backup(ks)
                assert node.counts.written == len(ks) and not node.counts.given_up, node.counts
            else:
                node.poison()
                got, idx = node.prefetch(ks)
                assert got == len(ks), (got, len(ks))
                assert idx is not None and node.wrong_pages(ks, idx, got) == []
            print(f"{role} ok {len(ks)} host_bytes={node.host_bytes}")
        finally:
            node.close()


if __name__ == "__main__":
    main()
