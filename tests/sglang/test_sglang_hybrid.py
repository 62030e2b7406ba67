"""Hybrid models' host pools (SGLang's batch_*_v2): a real ``MambaPoolHost`` registered beside
the KV pool as SGLang's hybrid cache controller registers it, its state pages stored in and
loaded from kvtierd (L2, then the file L3 after a crash), and ``batch_exists_v2`` folding
each pool's hit policy into the usable prefix as SGLang's own file backend does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvtier.testing.sglang import Kvtierd, keys, wait_for, worker

STATES = 16
MAMBA_LAYERS = 3


def inner(backend):
    return getattr(backend, "_backend", backend)


def mamba_pool(layout: str) -> MambaPoolHost:
    """SGLang's host pool of Mamba states over a CPU device pool: per layer an fp32 temporal
    (SSM) state and a bf16 conv state, so a page mixes element types."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, STATES, 4, 8, 8, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, STATES, 16, 3, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=STATES, pin_memory=False, device="cpu", layout=layout
    )


def hybrid(socket: str, layout: str = "page_first", **settings):
    w = worker(socket, layout=layout, **settings)
    pool = mamba_pool(layout)
    w.backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    return w, pool


def fill_states(pool: MambaPoolHost, indices: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in indices:
        page = torch.randint(0, 256, (pool.get_dummy_flat_data_page().numel(),), generator=g)
        pool.set_from_flat_data_page(i, page.to(torch.uint8))
        out.append(pool.get_data_page(i).clone())
    return out


def states(name, ks: list[str], indices: list[int], policy=PoolHitPolicy.TRAILING_PAGES):
    return PoolTransfer(
        name=name,
        host_indices=torch.tensor(indices, dtype=torch.int64),
        keys=ks,
        hit_policy=policy,
    )


def chain_info(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix or None)


@pytest.fixture
def daemon(tmp_path: Path):
    d = Kvtierd(tmp_path / "kvtierd", "l2.take_over_after_crash=false")
    yield d
    d.stop()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_states_round_trip_bit_identical(daemon: Kvtierd, layout: str):
    w, pool = hybrid(daemon.socket, layout)
    ks = keys(6, salt=f"mamba-{layout}")
    want = fill_states(pool, [2, 5], seed=1)
    # States at the ends of two backed-up spans: after page 3 and after page 6.
    got = w.backend.batch_set_v2([states(PoolName.MAMBA, [ks[2]], [2])], chain_info(ks[:2]))
    assert got == {PoolName.MAMBA: [True]}
    got = w.backend.batch_set_v2([states(PoolName.MAMBA, [ks[5]], [5])], chain_info(ks[:5]))
    assert got == {PoolName.MAMBA: [True]}
    pool.clear()
    for i in (2, 5):
        pool.set_from_flat_data_page(i, torch.zeros_like(pool.get_dummy_flat_data_page()))
    got = w.backend.batch_get_v2([states(PoolName.MAMBA, [ks[5]], [9])], chain_info(ks[:5]))
    assert got == {PoolName.MAMBA: [True]}
    assert torch.equal(pool.get_data_page(9), want[1])
    got = w.backend.batch_get_v2([states(PoolName.MAMBA, [ks[2]], [11])], chain_info(ks[:2]))
    assert got == {PoolName.MAMBA: [True]}
    assert torch.equal(pool.get_data_page(11), want[0])
    # A state never stored is a miss.
    got = w.backend.batch_get_v2([states(PoolName.MAMBA, [ks[3]], [12])], chain_info(ks[:3]))
    assert got == {PoolName.MAMBA: [False]}
    assert inner(w.backend).counters[f"v2_set_pages:{PoolName.MAMBA}"] == 2


def test_exists_v2_folds_each_pools_hit_policy(daemon: Kvtierd):
    w, pool = hybrid(daemon.socket)
    # A second hybrid pool with the all-pages policy: SGLang's MHA host pool class, registered
    # under the sliding-window name (any pool class with flat data pages works).
    swa = worker(daemon.socket, layout="page_first", model="test/swa").host
    w.backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    ks = keys(8, salt="fold")
    w.fill(0, 6, seed=2)
    assert w.backend.batch_set_v1(ks[:6], w.indices(0, 6)) == [True] * 6
    fill_states(pool, [0, 1], seed=3)
    for page, slot in ((2, 0), (5, 1)):  # states after pages 3 and 6
        r = w.backend.batch_set_v2(
            [states(PoolName.MAMBA, [ks[page]], [slot])], chain_info(ks[:page])
        )
        assert r == {PoolName.MAMBA: [True]}
    trailing = states(PoolName.MAMBA, [ks[0]], [0])

    r = w.backend.batch_exists_v2(ks, [trailing])
    # KV covers 6 pages; a state exists at 3 and 6: both lengths can be restored.
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [3, 6])
    assert r.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6}

    # The all-pages pool holds its first 4 pages only: of the lengths the state allows, only
    # 3 remains.
    sw = PoolTransfer(
        name=PoolName.SWA,
        host_indices=torch.arange(0, 4 * 16, dtype=torch.int64),
        keys=ks[:4],
        hit_policy=PoolHitPolicy.ALL_PAGES,
    )
    assert w.backend.batch_set_v2([sw], chain_info([])) == {PoolName.SWA: [True] * 4}
    r = w.backend.batch_exists_v2(ks, [trailing, sw])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [3])
    assert r.extra_pool_hit_pages[PoolName.SWA] == 4

    # A two-page trailing window needs states after pages 5 and 6: only 6 has one.
    two = states(PoolName.MAMBA, ks[:2], [0, 1])
    assert w.backend.batch_exists_v2(ks, [two]).restorable_prefix_pages == []
    # No KV: nothing, whatever the pools hold.
    assert w.backend.batch_exists_v2(keys(4, salt="none"), [trailing]).kv_hit_pages == 0


def test_states_come_back_from_l3_after_a_crash_and_other_ranks_do_not_see_them(
    daemon: Kvtierd,
):
    w, pool = hybrid(daemon.socket, reconnect_interval_s=0.1)
    ks = keys(4, salt="crash-state")
    want = fill_states(pool, [3], seed=4)
    got = w.backend.batch_set_v2([states(PoolName.MAMBA, [ks[3]], [3])], chain_info(ks[:3]))
    assert got == {PoolName.MAMBA: [True]}
    wait_for(lambda: len(daemon.l3_files()) >= 1, what="the state in the file L3")
    daemon.kill()
    daemon.start()
    got = wait_for(
        lambda: (
            w.backend.batch_get_v2([states(PoolName.MAMBA, [ks[3]], [7])], chain_info(ks[:3]))[
                PoolName.MAMBA
            ]
            == [True]
        ),
        what="the state from L3",
    )
    assert got and torch.equal(pool.get_data_page(7), want[0])
    # Mamba states are sharded per TP rank: rank 1 of the same model holds none of rank 0's.
    other, _ = hybrid(daemon.socket, tp_rank=1, tp_size=2)
    r = other.backend.batch_get_v2([states(PoolName.MAMBA, [ks[3]], [1])], chain_info(ks[:3]))
    assert r == {PoolName.MAMBA: [False]}


def test_v2_failures_are_misses_never_exceptions(tmp_path: Path):
    d = Kvtierd(tmp_path / "kvtierd")
    w, pool = hybrid(d.socket, timeout_s=1.0)
    ks = keys(2, salt="fail")
    # A pool SGLang never registered, and host indices that do not match the keys.
    unknown = states(PoolName.INDEXER, [ks[0]], [0])
    assert w.backend.batch_set_v2([unknown]) == {PoolName.INDEXER: [False]}
    short = states(PoolName.MAMBA, ks, [0])
    assert w.backend.batch_set_v2([short]) == {PoolName.MAMBA: [False, False]}
    assert w.backend.batch_exists_v2(ks, [unknown]).kv_hit_pages == 0
    d.stop()
    ok = states(PoolName.MAMBA, [ks[0]], [0])
    assert w.backend.batch_set_v2([ok]) == {PoolName.MAMBA: [False]}
    assert w.backend.batch_get_v2([ok]) == {PoolName.MAMBA: [False]}
    assert w.backend.batch_exists_v2(ks, [ok]).kv_hit_pages == 0
    errors = {k: v for k, v in inner(w.backend).counters.items() if k.startswith("error:")}
    assert errors.get("error:set_v2", 0) >= 2, errors
