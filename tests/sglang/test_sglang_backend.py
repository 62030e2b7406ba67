"""kvtier.sglang.KvtierStorage inside the real SGLang package (pinned, from PyPI): loaded by
SGLang's own storage factory as its ``dynamic`` backend, over SGLang's own host pools, against
a real kvtierd process (file L3 on a real directory).

kvtierd is the binary `cargo test` built (scripts/test runs this after it); KVTIERD_BIN
overrides it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvtier
import kvtier.sglang
from kvtier.testing.sglang import LAYOUTS, ROOT, Kvtierd, keys, wait_for, worker


def inner(backend):
    """The kvtier backend under SGLang's fault-injection wrapper, if there is one."""
    return getattr(backend, "_backend", backend)


@pytest.fixture
def daemon(tmp_path: Path):
    d = Kvtierd(tmp_path / "kvtierd")
    yield d
    d.stop()


def test_the_package_under_test_is_this_checkout() -> None:
    assert Path(kvtier.__file__).resolve().is_relative_to(ROOT / "python"), kvtier.__file__


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pages_round_trip_bit_identical_between_every_layout(daemon: Kvtierd, mla: bool):
    """Pages written from one layout read back identical in every layout: kvtier stores one
    byte order, whatever the pool's."""
    writers = {layout: worker(daemon.socket, layout, mla=mla) for layout in LAYOUTS}
    for n, (layout, w) in enumerate(writers.items()):
        ks = keys(6, salt=f"{layout}-{mla}")
        want = w.fill(2, 6, seed=n)
        assert w.backend.batch_exists(ks) == 0
        assert w.backend.batch_set_v1(ks, w.indices(2, 6)) == [True] * 6
        assert w.backend.batch_exists(ks) == 6
        # Writing the same pages again is a success with nothing to copy.
        assert w.backend.batch_set_v1(ks, w.indices(2, 6)) == [True] * 6
        for reader in writers.values():
            reader.clear()
            assert reader.backend.batch_get_v1(ks, reader.indices(10, 6)) == [True] * 6
            for i in range(6):
                assert torch.equal(reader.canonical(10 + i), want[i]), (layout, reader.layout, i)
    # Through the older tensor-per-page calls too.
    w = writers["page_first"]
    ks = keys(2, salt=f"flat-{mla}")
    w.fill(0, 2, seed=99)
    pages = [w.host.get_data_page(i * 16, flat=True).clone() for i in range(2)]
    assert inner(w.backend).batch_set(ks, pages) is True
    out = [torch.zeros_like(p) for p in pages]
    got = inner(w.backend).batch_get(ks, out)
    # Random bytes hold NaNs: compare bytes, not values.
    assert all(
        g is not None and torch.equal(g.view(torch.uint8), p.view(torch.uint8))
        for g, p in zip(got, pages)
    )
    assert inner(w.backend).exists(ks[0]) and not inner(w.backend).exists(keys(1, "x")[0])


def test_a_partial_hit_is_a_prefix_and_misses_are_false(daemon: Kvtierd):
    w = worker(daemon.socket)
    ks = keys(8, salt="partial")
    w.fill(0, 8, seed=1)
    assert w.backend.batch_set_v1(ks[:5], w.indices(0, 5)) == [True] * 5
    assert w.backend.batch_exists(ks) == 5
    assert w.backend.batch_get_v1(ks, w.indices(20, 8)) == [True] * 5 + [False] * 3


def test_tp_ranks_and_models_do_not_share_pages_but_mla_ranks_do(daemon: Kvtierd):
    a = worker(daemon.socket, tp_rank=0, tp_size=2)
    b = worker(daemon.socket, tp_rank=1, tp_size=2)
    other = worker(daemon.socket, tp_rank=0, tp_size=2, model="another/model")
    ks = keys(3, salt="tp")
    a.fill(0, 3, seed=2)
    assert a.backend.batch_set_v1(ks, a.indices(0, 3)) == [True] * 3
    assert b.backend.batch_exists(ks) == 0 and other.backend.batch_exists(ks) == 0
    assert a.backend.batch_exists(ks) == 3
    # MLA: rank 0 writes for every rank; the others report success and read rank 0's pages.
    m0 = worker(daemon.socket, mla=True, tp_rank=0, tp_size=2)
    m1 = worker(daemon.socket, mla=True, tp_rank=1, tp_size=2)
    mk = keys(2, salt="mla-tp")
    want = m0.fill(0, 2, seed=3)
    m1.fill(0, 2, seed=4)
    assert m1.backend.batch_set_v1(mk, m1.indices(0, 2)) == [True, True]
    assert m1.backend.batch_exists(mk) == 0, "a non-writer rank must not write"
    assert m0.backend.batch_set_v1(mk, m0.indices(0, 2)) == [True, True]
    m1.clear()
    assert m1.backend.batch_get_v1(mk, m1.indices(4, 2)) == [True, True]
    assert torch.equal(m1.canonical(4), want[0]) and torch.equal(m1.canonical(5), want[1])


def test_a_namespace_separates_tenants(daemon: Kvtierd):
    a = worker(daemon.socket, namespace="team-a")
    b = worker(daemon.socket, namespace="team-b")
    ks = keys(2, salt="ns")
    a.fill(0, 2, seed=5)
    assert a.backend.batch_set_v1(ks, a.indices(0, 2)) == [True, True]
    assert a.backend.batch_exists(ks) == 2 and b.backend.batch_exists(ks) == 0


CHILD = r"""
import sys, torch
from kvtier.testing.sglang import worker, keys
w = worker(sys.argv[1])
want = w.fill(0, 8, seed=7)
assert w.backend.batch_set_v1(keys(8, "shared"), w.indices(0, 8)) == [True] * 8
torch.save(want, sys.argv[2])
"""


def test_two_sglang_processes_share_pages_through_one_kvtierd(daemon: Kvtierd, tmp_path: Path):
    out = tmp_path / "want.pt"
    subprocess.run(
        [sys.executable, "-c", CHILD, daemon.socket, str(out)],
        check=True,
        timeout=300,
    )
    want = torch.load(out)
    w = worker(daemon.socket, layout="page_first_direct")
    assert w.backend.batch_exists(keys(8, "shared")) == 8
    assert w.backend.batch_get_v1(keys(8, "shared"), w.indices(30, 8)) == [True] * 8
    assert all(torch.equal(w.canonical(30 + i), want[i]) for i in range(8))


def test_after_a_kvtierd_crash_pages_come_back_from_l3_and_the_client_reconnects(tmp_path: Path):
    # No takeover of the dead daemon's L2: every page must come back from the file L3.
    d = Kvtierd(tmp_path / "kvtierd", "l2.take_over_after_crash=false")
    try:
        w = worker(d.socket, reconnect_interval_s=0.1)
        ks = keys(12, salt="crash")
        want = w.fill(0, 12, seed=8)
        assert w.backend.batch_set_v1(ks, w.indices(0, 12)) == [True] * 12
        wait_for(lambda: len(d.l3_files()) >= 12, what="12 pages in the file L3")
        old = inner(w.backend)._kv._session
        d.kill()
        d.start()
        w.clear()
        got = wait_for(lambda: w.backend.batch_exists(ks) == 12 or None, what="reconnect")
        assert got
        assert w.backend.batch_get_v1(ks, w.indices(40, 12)) == [True] * 12
        assert all(torch.equal(w.canonical(40 + i), want[i]) for i in range(12))
        assert inner(w.backend).counters["sessions"] == 2
        # The dead daemon's pool is unmapped (a mapping would keep its memory alive).
        assert old.closed and old.pool._anchor is None
    finally:
        d.stop()


def test_a_damaged_stored_page_is_a_miss(tmp_path: Path):
    d = Kvtierd(tmp_path / "kvtierd", "l2.take_over_after_crash=false")
    try:
        w = worker(d.socket, reconnect_interval_s=0.1)
        ks = keys(4, salt="damage")
        w.fill(0, 4, seed=9)
        assert w.backend.batch_set_v1(ks, w.indices(0, 4)) == [True] * 4
        wait_for(lambda: len(d.l3_files()) >= 4, what="4 pages in the file L3")
        d.kill()
        for f in d.l3_files():  # one flipped byte in the middle of every stored object
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        d.start()
        w.clear()
        wait_for(lambda: inner(w.backend)._kv.session(), what="reconnect")
        got = w.backend.batch_get_v1(ks, w.indices(8, 4))
        assert got == [False] * 4
    finally:
        d.stop()


def test_sglang_fault_injection_gives_misses_never_exceptions(daemon: Kvtierd, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    w = worker(daemon.socket)
    assert type(w.backend).__name__ == "HiCacheStorageFailureInjector"
    ks = keys(16, salt="inject")
    want = w.fill(0, 16, seed=10)
    outcomes = set()
    for _ in range(20):
        r = w.backend.batch_set_v1(ks, w.indices(0, 16))
        assert isinstance(r, list) and len(r) == 16 and all(isinstance(x, bool) for x in r)
        outcomes.add(all(r))
        if all(r):
            break
    assert True in outcomes
    for _ in range(20):
        w.clear()
        r = w.backend.batch_get_v1(ks, w.indices(20, 16))
        assert isinstance(r, list) and len(r) == 16
        outcomes.add(all(r))
        for i, ok in enumerate(r):
            if ok:
                assert torch.equal(w.canonical(20 + i), want[i])
        assert isinstance(w.backend.batch_exists(ks), int)
    assert outcomes == {True, False}, "with p=0.5 both outcomes should show in 40 calls"


def test_with_kvtierd_stopped_every_call_misses_within_its_timeout(tmp_path: Path):
    d = Kvtierd(tmp_path / "kvtierd")
    w = worker(d.socket, timeout_s=1.0, reconnect_interval_s=0.2)
    ks = keys(4, salt="stopped")
    w.fill(0, 4, seed=11)
    assert w.backend.batch_set_v1(ks, w.indices(0, 4)) == [True] * 4
    wait_for(lambda: len(d.l3_files()) >= 4, what="4 pages in the file L3")
    d.kill()
    for call in (
        lambda: w.backend.batch_exists(ks),
        lambda: w.backend.batch_set_v1(keys(4, "new"), w.indices(0, 4)),
        lambda: w.backend.batch_get_v1(ks, w.indices(8, 4)),
    ):
        for _ in range(3):
            t = time.monotonic()
            r = call()
            assert time.monotonic() - t < 2.5, "a call outlived its timeout"
            assert r in (0, [False] * 4), r
    # A backend created while kvtierd is down also only misses, and connects once it is up.
    late = worker(d.socket, reconnect_interval_s=0.1)
    assert late.backend.batch_exists(ks) == 0
    d.start()
    try:
        assert wait_for(lambda: late.backend.batch_exists(ks) == 4 or None, what="late connect")
    finally:
        d.stop()


def test_many_threads_at_once_lose_nothing(daemon: Kvtierd):
    """SGLang's prefetch and backup threads of several workers, all at once: every page
    written is found, and every page read is the one written."""
    workers = [worker(daemon.socket, layout) for layout in LAYOUTS for _ in range(2)]
    # Workers 0 and 4, 1 and 5 write the same pages (same keys, same bytes) at once.
    chains = {i: keys(12, salt=f"thread-{i % 4}") for i in range(len(workers))}
    nbytes = workers[0].canonical(0).numel()
    content = {
        c: torch.randint(
            0, 256, (12, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(c)
        )
        for c in range(4)
    }
    wants = {}
    for i, w in enumerate(workers):
        wants[i] = list(content[i % 4])
        for p in range(12):
            w.put_canonical(p, wants[i][p])
    errors: list[BaseException] = []

    def run(i: int) -> None:
        w = workers[i]
        try:
            for round_ in range(5):
                assert w.backend.batch_set_v1(chains[i], w.indices(0, 12)) == [True] * 12
                got = w.backend.batch_get_v1(chains[i], w.indices(40 + 12 * (round_ % 2), 12))
                assert got == [True] * 12
                for p in range(12):
                    assert torch.equal(w.canonical(40 + 12 * (round_ % 2) + p), wants[i][p])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    stats = [inner(w.backend).get_stats() for w in workers]
    assert sum(sum(s.prefetch_pgs) for s in stats) == 12 * 5 * len(workers)


def test_bad_settings_are_refused_by_name(daemon: Kvtierd):
    with pytest.raises(ValueError, match="prefetch_policy.*wait_complete"):
        worker(daemon.socket, prefetch_policy="eventually")
    with pytest.raises(ValueError, match=r"extra_config\.timeout_s: expected a float"):
        worker(daemon.socket, timeout_s="soon")
    with pytest.raises(ValueError, match="model_id"):
        worker(daemon.socket, model="")


def test_every_method_of_sglangs_interface_is_kvtiers_own() -> None:
    """Every method of SGLang's HiCacheStorage is KvtierStorage's own (none falls back to the
    base class's `pass`, which returns None and kills SGLang's storage threads)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    base = {n for n, v in vars(HiCacheStorage).items() if callable(v) and not n.startswith("_")}
    mine = set(vars(kvtier.sglang.KvtierStorage))
    assert base - mine <= {"register_mem_host_pool_v2", "on_host_pools_registered"}, base - mine


def test_fp8_formats_never_share_pages(daemon: Kvtierd):
    """SGLang's host pools store every fp8 format as uint8: only the format in the cache
    identity (docs/identity.md) keeps E4M3 pages from E5M2 readers."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    w = worker(daemon.socket, dtype=e4m3, kv_cache_dtype="fp8_e4m3")
    ks = keys(4, salt="fp8")
    w.fill(0, 4, seed=1)
    assert w.backend.batch_set_v1(ks, w.indices(0, 4)) == [True] * 4
    other = worker(daemon.socket, dtype=e5m2, kv_cache_dtype="fp8_e5m2")
    assert other.backend.batch_exists(ks) == 0
    assert other.backend.batch_get_v1(ks, other.indices(0, 4)) == [False] * 4
    same = worker(daemon.socket, dtype=e4m3, kv_cache_dtype="fp8_e4m3")
    assert same.backend.batch_exists(ks) == 4
    # With no format known (no setting, no server args), an fp8 pool's pages are its own.
    blind = [worker(daemon.socket, dtype=e4m3) for _ in range(2)]
    blind[0].fill(0, 4, seed=2)
    assert blind[0].backend.batch_set_v1(ks, blind[0].indices(0, 4)) == [True] * 4
    assert blind[0].backend.batch_exists(ks) == 4
    assert blind[1].backend.batch_exists(ks) == 0


def test_clear_moves_the_instance_to_a_new_weight_epoch(daemon: Kvtierd):
    """SGLang's clear (``/clear_hicache_storage_backend``, as after a weight update): the
    instance never finds a page stored before; other instances keep theirs."""
    w, peer = worker(daemon.socket), worker(daemon.socket)
    ks = keys(5, salt="epoch")
    old = w.fill(0, 5, seed=3)
    assert w.backend.batch_set_v1(ks, w.indices(0, 5)) == [True] * 5
    assert w.backend.batch_exists(ks) == 5
    w.backend.clear()
    assert w.backend.batch_exists(ks) == 0
    assert w.backend.batch_get_v1(ks, w.indices(8, 5)) == [False] * 5
    assert inner(w.backend).counters["clears"] == 1
    # The peer (still on the old weights) is unaffected.
    peer.clear()
    assert peer.backend.batch_get_v1(ks, peer.indices(0, 5)) == [True] * 5
    assert all(torch.equal(peer.canonical(i), old[i]) for i in range(5))
    # What the cleared instance computes next is stored and found under its new epoch.
    new = w.fill(0, 5, seed=4)
    assert w.backend.batch_set_v1(ks, w.indices(0, 5)) == [True] * 5
    w.clear()
    assert w.backend.batch_get_v1(ks, w.indices(0, 5)) == [True] * 5
    assert all(torch.equal(w.canonical(i), new[i]) for i in range(5))


def test_a_backup_running_across_a_clear_stays_in_the_old_epoch(daemon: Kvtierd, monkeypatch):
    """A batch_set_v1 that SGLang's backup thread began before a clear() (pages computed with
    the old weights) keys every page in the old epoch: none is filed under the new one, and
    the batch is not split between the two."""
    w, peer = worker(daemon.socket), worker(daemon.socket)
    ks = keys(6, salt="across")
    w.fill(0, 6, seed=5)
    backend = inner(w.backend)
    real = type(backend)._key
    cleared = []

    def key_then_clear(key: str, seed: bytes | None) -> bytes:
        out = real(key, seed)
        if not cleared:
            cleared.append(True)
            backend.clear()  # the weight update lands after the first key
        return out

    monkeypatch.setattr(type(backend), "_key", staticmethod(key_then_clear))
    assert w.backend.batch_set_v1(ks, w.indices(0, 6)) == [True] * 6
    monkeypatch.undo()
    assert cleared and backend.counters["clears"] == 1
    # Under the old epoch, whole; under the new one, nothing.
    assert peer.backend.batch_exists(ks) == 6
    assert w.backend.batch_exists(ks) == 0


def test_a_burst_faster_than_l3_drains_loses_no_page(tmp_path: Path):
    """3x L2's room in 4-page batch_set_v1 calls while every L3 write takes 20 ms: the
    calls wait for L3 to drain (backpressure) instead of refusing pages, and every page reads
    back bit-identical from L2 or L3."""
    d = Kvtierd(tmp_path / "kvtierd", "l2.pool_pages=32", "l3.fault_set_delay=20ms")
    try:
        w = worker(d.socket)
        n = 96
        ks = keys(n, salt="burst")
        want = w.fill(0, n, seed=9)
        results = []
        for i in range(0, n, 4):
            results += w.backend.batch_set_v1(ks[i : i + 4], w.indices(i, 4))
        assert results == [True] * n, results.count(False)
        counters = inner(w.backend).counters
        assert counters["set_no_space"] == 0 and counters["set_waits"] > 0, counters
        reader = worker(d.socket)
        for i in range(0, n, 8):
            assert reader.backend.batch_get_v1(ks[i : i + 8], reader.indices(i, 8)) == [True] * 8
        assert all(torch.equal(reader.canonical(i), want[i]) for i in range(n))
    finally:
        d.stop()


def test_a_slow_l3_read_ends_within_sglangs_prefetch_budget(tmp_path: Path):
    """SGLang has one prefetch thread: a load must not wait on L3 longer than SGLang's own
    budget (1 s + 0.25 s per 1024 tokens), whatever L3 does."""
    d = Kvtierd(tmp_path / "kvtierd", "l2.pool_pages=16", "l3.fault_get_delay=5s")
    try:
        w = worker(d.socket)
        ks = keys(48, salt="slow")
        w.fill(0, 48, seed=5)
        for i in range(0, 48, 4):
            assert w.backend.batch_set_v1(ks[i : i + 4], w.indices(i, 4)) == [True] * 4
        # The first pages were evicted from the 16-page L2 and live in L3 only.
        assert w.backend.batch_exists(ks[:4]) == 4
        for _ in range(2):
            start = time.monotonic()
            got = w.backend.batch_get_v1(ks[:4], w.indices(100, 4))
            took = time.monotonic() - start
            assert got == [False] * 4
            assert took < 1.0 + 0.25 * 64 / 1024 + 1.0, took
    finally:
        d.stop()


def test_the_checkpoint_and_weight_version_keep_pages_apart_never_the_served_alias(
    daemon: Kvtierd, tmp_path: Path
):
    """In a running SGLang server the backend reads --model-path and --weight-version from
    SGLang's runtime context; the name SGLang passes it is the served alias, which two
    deployments with different weights may share."""
    import json

    def checkpoint(name: str) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "num_hidden_layers": 4,
                    "intermediate_size": 128,
                    "vocab_size": 1000,
                    "max_position_embeddings": 4096,
                    "torch_dtype": "bfloat16",
                }
            )
        )
        return str(d)

    a, b = checkpoint("weights-a"), checkpoint("weights-b")

    def served(path: str, alias: str, *extra: str) -> int:
        script = Path(__file__).with_name("served_worker.py")
        cmd = [sys.executable, str(script), "--socket", daemon.socket]
        r = subprocess.run(
            [*cmd, "--model-path", path, "--alias", alias, *extra],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).parent,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])["result"]

    assert served(a, "llm", "--write", "4") == 4
    assert served(b, "llm", "--exists", "4") == 0  # same alias, other weights
    assert served(a, "chat", "--exists", "4") == 4  # same weights, other alias
    assert served(a, "llm", "--weight-version", "v2", "--exists", "4") == 0


def test_a_longrope_model_past_its_original_context_is_refused(tmp_path: Path):
    """SGLang's LongRoPE picks its long or short factors for a whole batch: the K of a
    prompt's first page differs with what else is in the batch, so no page of such a model
    could be shared (review of issue 61). Refused by name, unless served within its original
    context, where the short factors always apply."""
    import json
    from types import SimpleNamespace

    from sglang.srt.layers.rotary_embedding.rope_variant import (
        Phi3LongRoPEScaledRotaryEmbedding as LongRope,
    )

    from kvtier.integrations.sglang.backend import _refuse_batch_dependent_rope

    head, orig = 16, 4096
    rope = LongRope(
        head, head, 131072, orig, 10000, True, torch.float32, [1.0] * (head // 2), [4.0] * 8
    )
    torch.manual_seed(0)
    q, k = torch.randn(16, head), torch.randn(16, head)
    _, alone = rope(torch.arange(16), q.clone(), k.clone())
    batch = torch.cat([torch.arange(16), torch.tensor([orig + 1])])
    _, together = rope(batch, torch.cat([q, q[:1]]), torch.cat([k, k[:1]]))
    assert not torch.equal(alone.reshape(16, -1), together[:16].reshape(16, -1))

    scaling = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    cfg = {
        "model_type": "phi3",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": orig,
    }

    def write(rope: dict, name: str) -> Path:
        # A directory per config: SGLang caches the configs it loaded, by path.
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope}))
        return tmp_path / name

    model = write(scaling, "phi-longrope")
    args = SimpleNamespace(model_path=str(model), context_length=None)
    with pytest.raises(ValueError, match="LongRoPE.*--context-length 4096"):
        _refuse_batch_dependent_rope(args)
    args.context_length = 8192
    with pytest.raises(ValueError, match="LongRoPE"):
        _refuse_batch_dependent_rope(args)
    # Within the original context: always the short factors.
    args.context_length = orig
    _refuse_batch_dependent_rope(args)
    # Equal factors: nothing batch-dependent.
    same = write({**scaling, "long_factor": [1.0] * 8}, "phi-same")
    _refuse_batch_dependent_rope(SimpleNamespace(model_path=str(same), context_length=None))
    # A config that cannot be read cannot be checked: refused, naming why.
    with pytest.raises(ValueError, match="cannot read the config"):
        _refuse_batch_dependent_rope(
            SimpleNamespace(model_path=str(tmp_path / "nowhere"), context_length=None)
        )
