"""SGLang's ``--hicache-host-memory-mode buffer_only`` with kvtier as the ``dynamic`` storage
backend: the host pool is a staging buffer and kvtierd's node-wide L2 is the host cache.

SGLang's own HiCacheController, built with ``host_memory_mode`` ``buffer_only`` (and
``cache`` to compare), over its own MHA and MLA host pools in every layout, with kvtier loaded
by its storage factory, against real kvtierd processes. kvtier/testing/sglang_controller.py says
which steps run in SGLang's place on a CPU.

Not covered on a CPU: UnifiedRadixCache's buffer pipeline itself and its SWA / Mamba sidecar
pools (HybridCacheController). Built with ``buffer_only`` on a CPU, its pool assembler makes
the host pool with ``pin_memory=True`` (cudaHostRegister: "Found no NVIDIA driver"); past
that, every backup starts with a device → host copy through ``transfer_kv_*`` kernels that
SGLang imports only on CUDA, ROCm and XPU, and every prefetch hit query hashes tokens with a
C++ extension compiled with ninja at first use. The staging lifecycle it drives (stage,
write, free at the storage ack; hit-sized bounce, freed once read) is what Node does here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.arg_groups.hicache_hook import handle_hicache
from sglang.srt.managers.cache_controller import HICACHE_LOAD_POOL_USAGE_FRACTION
from sglang.srt.server_args import ServerArgs

from kvtier.testing.sglang import LAYOUTS, PAGE, ROOT, Kvtierd, keys
from kvtier.testing.sglang_controller import Node, page_bytes, single_rank

MODES = ("buffer_only", "cache")


@pytest.fixture(autouse=True)
def one_rank():
    with single_rank():
        yield


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Kvtierd(tmp_path_factory.mktemp("bo") / "kvtierd")
    yield d
    d.stop()


def server_args(**kw) -> ServerArgs:
    args = ServerArgs(model_path="dummy", enable_hierarchical_cache=True, hicache_ratio=1.2, **kw)
    handle_hicache(args)  # SGLang's resolution of the HiCache flags
    return args


def test_sglang_takes_buffer_only_with_every_layout_and_refuses_it_without_storage():
    """SGLang's checks of the HiCache flags accept buffer_only with the dynamic backend in
    every host layout kvtier serves, with either io backend (SGLang itself pairs page_first
    with the kernel backend and page_first_direct with direct), and refuse buffer_only with
    no storage backend."""
    for layout in LAYOUTS:
        for io in ("direct", "kernel"):
            server_args(
                hicache_host_memory_mode="buffer_only",
                hicache_storage_backend="dynamic",
                hicache_mem_layout=layout,
                hicache_io_backend=io,
            )
    with pytest.raises(ValueError, match="buffer_only requires a storage backend"):
        server_args(hicache_host_memory_mode="buffer_only")


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_pages_come_back_bit_identical_after_the_host_copy_is_gone(
    daemon: Kvtierd, mode: str, layout: str, mla: bool
):
    """Written through SGLang's backup thread, the host buffer freed (buffer_only) and
    poisoned, prefetched back through its prefetch threads: each page's bytes are its own."""
    node = Node(daemon.socket, mode, layout, mla=mla)
    try:
        assert node.cc.host_memory_mode == mode
        if mode == "buffer_only":  # loads may fill the staging buffer, not half of it
            assert node.cc.prefetch_capacity_limit == int(
                HICACHE_LOAD_POOL_USAGE_FRACTION * node.host.size
            )
        ks = keys(10, salt=f"rt-{mode}-{layout}-{mla}")
        assert node.hit(ks) == 0
        node.backup(ks, batch=4)
        assert node.counts.written == 10 and not node.counts.given_up, node.counts
        if mode == "buffer_only":
            # Nothing stays in host memory: every staging slot went back at its storage ack.
            assert node.host.available_size() == node.host.size
        else:
            assert set(node.resident) == set(ks)
        node.poison()
        got, idx = node.prefetch(ks)
        assert got == 10 and idx is not None
        assert node.wrong_pages(ks, idx, got) == []
        # A chain with an unknown page in the middle loads the prefix before it only.
        other = keys(3, salt="never-written")
        got, idx2 = node.prefetch(ks[:4] + other[:1] + ks[5:])
        assert got == 4 and idx2 is not None and node.wrong_pages(ks, idx2, 4) == []
    finally:
        node.close()


def worker_process(socket: str, role: str, layout: str, salt: str, n: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.testing.sglang_controller", socket, role, "buffer_only"]
        + [layout, salt, str(n)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_workers_in_separate_processes_share_pages_through_one_kvtierd(daemon: Kvtierd):
    """Worker A (its own process and staging buffer, layer_first) writes; worker B (another
    process, page_first_direct) and this one (page_first) read A's pages, bit-identical,
    with nothing of them in their own host memory."""
    assert "write ok 12" in worker_process(daemon.socket, "write", "layer_first", "shared", 12)
    assert "read ok 12" in worker_process(daemon.socket, "read", "page_first_direct", "shared", 12)
    node = Node(daemon.socket, "buffer_only", "page_first")
    try:
        ks = keys(12, salt="shared")
        node.poison()
        got, idx = node.prefetch(ks)
        assert got == 12 and idx is not None and node.wrong_pages(ks, idx, got) == []
    finally:
        node.close()


def test_a_burst_larger_than_the_host_buffer_loses_nothing(tmp_path: Path):
    """96 pages through a 12-page staging buffer into a 32-page L2 whose L3 writes take
    20 ms each: staging waits for storage acks, kvtierd for L3, and every page is stored
    (none given up) and reads back bit-identical."""
    d = Kvtierd(tmp_path / "kvtierd", "l2.pool_pages=32", "l3.fault_set_delay=20ms")
    node = Node(d.socket, "buffer_only", "page_first_direct", device_pages=32, ratio=0.375)
    try:
        staging = node.host.size // PAGE
        assert staging == 13  # 12 pages and SGLang's padding page
        n = 96
        ks = keys(n, salt="burst")
        node.backup(ks, batch=4)
        assert node.counts.given_up == {}, node.counts.given_up
        assert node.counts.written == n
        assert node.counts.peak_host_pages <= staging
        assert node.host.available_size() == node.host.size
        assert node.hit(ks) == n
        for i in range(0, n, 8):
            node.poison()
            got, idx = node.prefetch(ks[i : i + 8])
            assert got == 8 and idx is not None
            assert node.wrong_pages(ks[i : i + 8], idx, 8) == [], i
            node.release(idx)
        counters = node.cc.storage_backend.counters
        assert counters["set_no_space"] == 0, counters
    finally:
        node.close()
        d.stop()


def test_a_page_is_its_keys_bytes_only():
    """The page contents the tests compare with differ for every key (a misplaced page
    cannot pass for another)."""
    ks = keys(8, salt="distinct")
    pages = [page_bytes(k, 4096) for k in ks]
    assert all(not torch.equal(a, b) for i, a in enumerate(pages) for b in pages[i + 1 :])


def test_buffer_only_holds_a_quarter_of_cache_modes_host_memory_at_the_same_hit_rate():
    """benches/sglang_buffer_only.py, small: host bytes per worker, buffer_only / cache
    <= 0.25, hit rates equal, no wrong page, no page given up."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "sglang_buffer_only.py"), "--check"]
        + ["--requests", "24", "--prompts", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "buffer_only / cache host bytes per worker" in out.stdout
