"""kvtierd as SGLang's HiCache RPC storage server, driven by a Python client that does what
SGLang's does (hicache_rpc.py): a real kvtierd process, a real memfd registered over
SCM_RIGHTS, real gRPC over a Unix socket, the file backend on a real directory.

kvtierd is the binary built by `cargo test` (scripts/test runs this after it); set
KVTIERD_BIN to use another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvtier.testing import Kvtierd as KvtierdProcess
from kvtier.testing import hicache_rpc as rpc

OK, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE = 0, 3, 5, 9, 11


class Kvtierd(KvtierdProcess):
    """A kvtierd process on its own data directory, with [sglang_rpc] enabled."""

    def __init__(self, data_dir: Path, *sets: str, config: Path | None = None):
        super().__init__(data_dir, "sglang_rpc.enable=true", *sets, config=config)
        self.mempool = str(data_dir / "sglang-mempool.sock")
        self.grpc = str(data_dir / "sglang-grpc.sock")


@pytest.fixture
def daemon(tmp_path):
    d = Kvtierd(tmp_path / "kvtierd")
    yield d
    d.stop()


def connect(d: Kvtierd, size: int = 4 << 20, name: str = "tp0") -> rpc.Client:
    return rpc.Client(d.mempool, d.grpc, rpc.HostPool(size), name)


def pattern(seed: int, n: int) -> bytes:
    """Deterministic bytes, distinct per seed."""
    return bytes((seed * 131 + i * 7 + (i >> 8)) & 0xFF for i in range(n))


def test_single_and_multi_iovec_objects_round_trip(daemon):
    c = connect(daemon)
    k, v = pattern(1, 8192), pattern(2, 8192)
    whole = pattern(3, 16384)
    # A page as SGLang lays it out: its K and V halves at separate offsets (one object, two
    # iovecs), and a page in one run.
    c.pool.write(0, k)
    c.pool.write(1 << 20, v)
    c.pool.write(65536, whole)
    assert c.batch_put(
        [
            c.transfer("h1_0_k", [(0, 8192), (1 << 20, 8192)]),
            c.transfer("h2_0_k", [(65536, 16384)]),
        ]
    ) == [OK, OK]
    assert c.exist(["h1_0_k", "h2_0_k", "h3_0_k"]) == [True, True, False]
    # Back into other places, with another split of the same total length.
    assert c.batch_get(
        [
            c.transfer("h1_0_k", [(2 << 20, 4096), (3 << 20, 12288)]),
            c.transfer("h2_0_k", [(200_000, 16384)]),
        ]
    ) == [OK, OK]
    assert c.pool.read(2 << 20, 4096) + c.pool.read(3 << 20, 12288) == k + v
    assert c.pool.read(200_000, 16384) == whole
    c.close()


def test_batches_mix_present_and_missing_ids_independently(daemon):
    c = connect(daemon)
    n = 16
    page = 32768
    for i in range(n):
        c.pool.write(i * page, pattern(10 + i, page))
    # Several transfers per batch; only the even ones are stored.
    assert c.batch_put([c.transfer(f"p{i}", [(i * page, page)]) for i in range(0, n, 2)]) == [
        OK
    ] * (n // 2)
    dst = n * page
    c.pool.write(dst, b"\xee" * (n * page))
    r = c.batch_get([c.transfer(f"p{i}", [(dst + i * page, page)]) for i in range(n)])
    assert r == [OK if i % 2 == 0 else NOT_FOUND for i in range(n)]
    for i in range(n):
        got = c.pool.read(dst + i * page, page)
        # Found: bit-identical. Missing: its bytes untouched.
        assert got == (pattern(10 + i, page) if i % 2 == 0 else b"\xee" * page), i
    assert c.exist([f"p{i}" for i in range(n)]) == [i % 2 == 0 for i in range(n)]
    c.close()


def test_a_closed_registration_fails_with_failed_precondition(daemon):
    c = connect(daemon)
    c.pool.write(0, pattern(4, 4096))
    assert c.batch_put([c.transfer("before", [(0, 4096)])]) == [OK]
    c.unregister()
    deadline = time.time() + 5
    while True:
        r = c.batch_put([c.transfer("after", [(0, 4096)])])
        if r == [FAILED_PRECONDITION]:
            break
        assert time.time() < deadline, f"the pool outlived its registration: {r}"
        time.sleep(0.02)
    assert c.batch_get([c.transfer("before", [(0, 4096)])]) == [FAILED_PRECONDITION]
    # A new registration gets a new id and the stored object back.
    c2 = connect(daemon, name="tp0-again")
    assert c2.pool_id != c.pool_id
    assert c2.batch_get([c2.transfer("before", [(0, 4096)])]) == [OK]
    assert c2.pool.read(0, 4096) == pattern(4, 4096)
    c.close()
    c2.close()


def test_objects_are_served_after_kvtierd_restarts_with_the_file_backend(tmp_path):
    data = tmp_path / "kvtierd"
    d = Kvtierd(data)
    c = connect(d)
    objs = {f"{i:064x}_0_k": pattern(20 + i, 65536) for i in range(8)}
    for i, b in enumerate(objs.values()):
        c.pool.write(i * 65536, b)
    assert (
        c.batch_put([c.transfer(oid, [(i * 65536, 65536)]) for i, oid in enumerate(objs)])
        == [OK] * 8
    )
    c.close()
    d.kill()  # no flush: a put is in L3 before it is answered
    # The crashed kvtierd's L2 (its memory of the objects) is not taken over: L3 serves them.
    d = Kvtierd(data, "l2.take_over_after_crash=false")
    try:
        c = connect(d)
        assert c.exist(list(objs)) == [True] * 8
        assert (
            c.batch_get([c.transfer(oid, [(i * 65536, 65536)]) for i, oid in enumerate(objs)])
            == [OK] * 8
        )
        for i, b in enumerate(objs.values()):
            assert c.pool.read(i * 65536, 65536) == b
        assert d.metric('kvtier_sglang_hits_total{op="get",tier="l3"}') == 8
        c.close()
    finally:
        d.stop()


def test_objects_kept_only_in_memory_survive_a_kvtierd_crash(tmp_path):
    """With no L3 the objects' only copy is kvtierd's own L2 pages: sealed as they land, a
    crashed kvtierd's successor takes their pool over and serves them, bit for bit."""
    data = tmp_path / "kvtierd"
    d = Kvtierd(data, "sglang_rpc.l3=none", "sglang_rpc.memory_bytes=4MiB")
    c = connect(d)
    objs = {f"{i:064x}_0_k": pattern(60 + i, 65536) for i in range(8)}
    for i, b in enumerate(objs.values()):
        c.pool.write(i * 65536, b)
    assert (
        c.batch_put([c.transfer(oid, [(i * 65536, 65536)]) for i, oid in enumerate(objs)])
        == [OK] * 8
    )
    deadline = time.time() + 10
    while d.metric("kvtier_l2_sealed_pages_total") < 8:
        assert time.time() < deadline, "the objects' pages were never sealed"
        time.sleep(0.02)
    c.close()
    d.kill()
    d = Kvtierd(data, "sglang_rpc.l3=none", "sglang_rpc.memory_bytes=4MiB")
    try:
        c = connect(d)
        assert c.exist(list(objs)) == [True] * 8
        c.pool.write(0, bytes(8 * 65536))
        assert (
            c.batch_get([c.transfer(oid, [(i * 65536, 65536)]) for i, oid in enumerate(objs)])
            == [OK] * 8
        )
        for i, b in enumerate(objs.values()):
            assert c.pool.read(i * 65536, 65536) == b
        assert d.metric('kvtier_sglang_hits_total{op="get",tier="memory"}') == 8
        assert d.metric('kvtier_l2_takeover_pages_total{outcome="adopted"}') == 8
        c.close()
    finally:
        d.stop()


def test_a_second_instance_is_served_from_kvtierd_memory(daemon):
    a = connect(daemon, name="instance-a")
    b = connect(daemon, name="instance-b")
    for i in range(4):
        a.pool.write(i * 65536, pattern(40 + i, 65536))
    assert (
        a.batch_put([a.transfer(f"shared{i}", [(i * 65536, 65536)]) for i in range(4)]) == [OK] * 4
    )
    assert (
        b.batch_get([b.transfer(f"shared{i}", [(i * 65536, 65536)]) for i in range(4)]) == [OK] * 4
    )
    for i in range(4):
        assert b.pool.read(i * 65536, 65536) == pattern(40 + i, 65536)
    assert daemon.metric('kvtier_sglang_hits_total{op="get",tier="memory"}') == 4
    assert (
        daemon.metric('kvtier_l3_backend_ops_total{backend="file",op="get",outcome="ok"}', absent=0)
        == 0
    )
    a.close()
    b.close()


def test_hostile_transfers_fail_in_their_slot_and_the_rest_proceed(daemon):
    c = connect(daemon, size=1 << 20)
    c.pool.write(0, pattern(5, 8192))
    r = c.batch_put(
        [
            c.transfer("good", [(0, 8192)]),
            c.transfer("outside", [((1 << 20) - 100, 4096)]),  # past the end of the pool
            c.transfer("wrap", [(2**64 - 16, 4096)]),  # offset + length overflows
            c.transfer("nopool", [(0, 4096)], pool_id=9999),  # unknown pool id
            c.transfer(b"", [(0, 4096)]),  # empty id
        ]
    )
    assert r == [OK, OUT_OF_RANGE, OUT_OF_RANGE, FAILED_PRECONDITION, INVALID_ARGUMENT]
    c.pool.write(100_000, b"\x11" * 4096)
    # A total length that differs from the stored object's: not found, bytes untouched, and
    # the object is still there at its own length.
    assert c.batch_get([c.transfer("good", [(100_000, 4096)])]) == [NOT_FOUND]
    assert c.pool.read(100_000, 4096) == b"\x11" * 4096
    assert c.batch_get([c.transfer("good", [(200_000, 8192)])]) == [OK]
    assert c.pool.read(200_000, 8192) == pattern(5, 8192)
    c.close()


@pytest.mark.parametrize(
    "case",
    ["bad_magic", "no_fd", "two_fds", "huge_name", "not_utf8", "short_then_close"],
)
def test_malformed_registrations_are_refused_and_the_daemon_keeps_serving(daemon, case):
    pool = rpc.HostPool(65536)
    other = rpc.HostPool(65536)
    if case == "bad_magic":
        s = rpc.send_registration(daemon.mempool, b"x", [pool.fd], magic=0xDEADBEEF)
    elif case == "no_fd":
        s = rpc.send_registration(daemon.mempool, b"x", [])
    elif case == "two_fds":
        s = rpc.send_registration(daemon.mempool, b"x", [pool.fd, other.fd])
    elif case == "huge_name":
        s = rpc.send_registration(daemon.mempool, b"n" * (1 << 20), [pool.fd])
    elif case == "not_utf8":
        s = rpc.send_registration(daemon.mempool, b"\xff\xfe", [pool.fd])
    else:
        import socket as so

        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.settimeout(10)
        s.connect(daemon.mempool)
        s.send(rpc.preamble(b"x")[:6])
        s.shutdown(so.SHUT_WR)
    assert rpc.read_pool_id(s) is None, "a malformed registration got a pool id"
    s.close()
    assert daemon.alive()
    assert daemon.metric("kvtier_sglang_pools") == 0
    # A well-formed client is served as before.
    c = connect(daemon)
    c.pool.write(0, pattern(6, 4096))
    assert c.batch_put([c.transfer("still-serving", [(0, 4096)])]) == [OK]
    c.close()
    pool.close()
    other.close()


def test_malformed_requests_get_a_status_and_lose_nothing(tmp_path):
    d = Kvtierd(tmp_path / "kvtierd", "sglang_rpc.max_batch=8")
    try:
        c = connect(d)
        c.pool.write(0, pattern(7, 4096))
        assert c.batch_put([c.transfer("kept", [(0, 4096)])]) == [OK]
        # More transfers than sglang_rpc.max_batch: InvalidArgument for the whole request.
        with pytest.raises(grpc.RpcError) as e:
            c.batch_get([c.transfer("kept", [(8192, 4096)]) for _ in range(9)])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sglang_rpc.max_batch" in e.value.details()
        # Bytes that are not a protobuf message at all: an error status (gRPC's rule for a
        # message that does not parse is INTERNAL), never a crash.
        raw = c.channel.unary_unary(
            "/sglang.runtime.hicache.StorageServer/BatchPut",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)
        assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        assert d.alive()
        assert c.batch_get([c.transfer("kept", [(8192, 4096)])]) == [OK]
        assert c.pool.read(8192, 4096) == pattern(7, 4096)
        c.close()
    finally:
        d.stop()


def test_a_client_that_shrinks_its_memfd_does_not_take_the_daemon_down(daemon):
    # A memfd created without MFD_ALLOW_SEALING (as os.memfd_create does by default) cannot
    # be sealed, so kvtierd copies with pread/pwrite and checks sizes before each transfer.
    c = connect(daemon, size=1 << 20)
    c.pool.write(500_000, pattern(8, 65536))
    assert c.batch_put([c.transfer("big", [(500_000, 65536)])]) == [OK]
    os.ftruncate(c.pool.fd, 4096)
    assert c.batch_get([c.transfer("big", [(500_000, 65536)])]) == [OUT_OF_RANGE]
    assert c.batch_put([c.transfer("big2", [(500_000, 65536)])]) == [OUT_OF_RANGE]
    assert daemon.alive()
    os.ftruncate(c.pool.fd, 1 << 20)
    assert c.batch_get([c.transfer("big", [(0, 65536)])]) == [OK]
    assert c.pool.read(0, 65536) == pattern(8, 65536)
    c.close()


def test_a_sealable_pool_is_sealed_against_shrinking(daemon):
    pool = rpc.HostPool(1 << 20, sealable=True)
    c = rpc.Client(daemon.mempool, daemon.grpc, pool, "sealable")
    # kvtierd sealed it: the pool cannot shrink under a copy any more.
    with pytest.raises(PermissionError):
        os.ftruncate(pool.fd, 4096)
    c.pool.write(0, pattern(9, 65536))
    assert c.batch_put([c.transfer("sealed", [(0, 65536)])]) == [OK]
    assert c.batch_get([c.transfer("sealed", [(300_000, 65536)])]) == [OK]
    assert c.pool.read(300_000, 65536) == pattern(9, 65536)
    c.close()


def test_many_concurrent_calls_on_one_channel(daemon):
    """HTTP/2 multiplexing through kvtierd's header relay: interleaved streams whose header
    blocks use grpcio's dynamic HPACK table all arrive intact."""
    from concurrent.futures import ThreadPoolExecutor

    c = connect(daemon, size=8 << 20)
    n = 32
    for i in range(n):
        c.pool.write(i * 4096, pattern(100 + i, 4096))
    assert c.batch_put([c.transfer(f"mux{i}", [(i * 4096, 4096)]) for i in range(n)]) == [OK] * n

    def worker(w: int) -> int:
        done = 0
        for r in range(25):
            i = (w * 7 + r) % n
            base = (1 << 20) + w * 65536
            assert c.exist([f"mux{i}", f"absent{w}-{r}"]) == [True, False]
            assert c.batch_get([c.transfer(f"mux{i}", [(base, 4096)])]) == [OK]
            assert c.pool.read(base, 4096) == pattern(100 + i, 4096)
            done += 1
        return done

    with ThreadPoolExecutor(max_workers=8) as ex:
        assert sum(ex.map(worker, range(8))) == 200
    c.close()


def test_a_pool_shrinking_during_copies_never_takes_the_daemon_down(daemon):
    """A client that keeps shrinking and regrowing its (unsealable) memfd while kvtierd copies
    into it: each transfer succeeds, is refused (11), or — once a copy hit the shrunk end — the
    pool is given up (9). kvtierd keeps running and serves a fresh registration correctly."""

    mib = 1 << 20
    c = connect(daemon, size=32 * mib)
    for i in range(8):
        c.pool.write(i * mib, pattern(60 + i, mib))
    assert c.batch_put([c.transfer(f"s{i}", [(i * mib, mib)]) for i in range(8)]) == [OK] * 8
    stop = threading.Event()

    def shrinker():
        while not stop.is_set():
            os.ftruncate(c.pool.fd, 2 * mib)
            os.ftruncate(c.pool.fd, 32 * mib)

    t = threading.Thread(target=shrinker)
    t.start()
    seen = set()
    try:
        for _ in range(60):
            r = c.batch_get([c.transfer(f"s{i % 8}", [((8 + i) * mib, mib)]) for i in range(16)])
            seen |= set(r)
    finally:
        stop.set()
        t.join()
    assert seen <= {OK, OUT_OF_RANGE, FAILED_PRECONDITION}, seen
    assert daemon.alive()
    c.close()
    c2 = connect(daemon, size=16 * mib, name="again")
    assert c2.batch_get([c2.transfer(f"s{i}", [(i * mib, mib)]) for i in range(8)]) == [OK] * 8
    for i in range(8):
        assert c2.pool.read(i * mib, mib) == pattern(60 + i, mib)
    c2.close()


def test_pool_ids_are_random_and_a_stale_id_never_reaches_another_pool(tmp_path):
    """Ids are random and non-zero: a client that kept its id across a kvtierd restart gets
    FAILED_PRECONDITION, never another client's pool (with ids counted from 1, the first
    client registered after the restart would have had its id)."""
    data = tmp_path / "kvtierd"
    d = Kvtierd(data)
    old = connect(d, name="old")
    ids = {old.pool_id}
    others = [connect(d, name=f"o{i}") for i in range(4)]
    ids |= {o.pool_id for o in others}
    assert len(ids) == 5 and 0 not in ids
    assert ids != set(range(1, 6)), "ids must not be counted from 1"
    for o in others:
        o.close()
    d.kill()
    d = Kvtierd(data)
    try:
        new = connect(d, name="new")
        assert new.pool_id not in ids
        new.pool.write(0, pattern(50, 4096))
        assert new.batch_put([new.transfer("mine", [(0, 4096)])]) == [OK]
        # The stale client, on a fresh channel to the new daemon, with its old id.
        stale = connect(d, name="stale")
        stale.pool_id = old.pool_id
        assert stale.batch_get([stale.transfer("mine", [(0, 4096)])]) == [FAILED_PRECONDITION]
        assert stale.batch_put([stale.transfer("x", [(0, 4096)])]) == [FAILED_PRECONDITION]
        assert new.batch_get([new.transfer("mine", [(0, 4096)])]) == [OK]
        new.close()
        stale.close()
    finally:
        d.stop()
        old.close()


def test_a_layer_first_batch_of_a_deep_model_fits_in_one_request(daemon):
    """SGLang's layer_first pools send one object per page, layer and part: 128 pages of an
    80-layer model are 20,480 objects in one request, all of which must go through (the old
    limit of 4,096 refused such requests)."""
    pages, layers, run = 128, 80, 64
    c = connect(daemon, size=pages * layers * 2 * run)
    blob = pattern(60, pages * layers * 2 * run)
    c.pool.write(0, blob)
    ids = [f"{p:060x}_{layer}_{kv}" for p in range(pages) for layer in range(layers) for kv in "kv"]
    transfers = [c.transfer(oid, [(i * run, run)]) for i, oid in enumerate(ids)]
    assert c.batch_put(transfers) == [OK] * len(ids)
    assert c.exist(ids) == [True] * len(ids)
    c.pool.write(0, bytes(len(blob)))
    assert c.batch_get(transfers) == [OK] * len(ids)
    assert c.pool.read(0, len(blob)) == blob
    c.close()


# Run in a child process whose primary gid is 65534 (tenant globex): the relay binds each
# gRPC connection to its peer's tenant, so this is how a second tenant's SGLang looks.
GLOBEX_CLIENT = """
import json, sys
from kvtier.testing import hicache_rpc as rpc
c = rpc.Client(sys.argv[1], sys.argv[2], rpc.HostPool(1 << 20), "globex")
seen = c.exist(["shared", "acme-only"])
c.pool.write(0, bytes([7]) * 4096)
put = c.batch_put([c.transfer("shared", [(0, 4096)]), c.transfer("globex-only", [(0, 4096)])])
c.pool.write(0, bytes(4096))
got = c.batch_get([c.transfer("shared", [(0, 4096)])])
print(json.dumps({"seen": seen, "put": put, "got": got, "bytes": c.pool.read(0, 4096).hex()}))
c.close()
"""


def test_tenants_bound_by_peer_never_share_objects(tmp_path):
    conf = tmp_path / "kvtierd.toml"
    conf.write_text("[tenants.acme]\ngids = [0]\n\n[tenants.globex]\ngids = [65534]\n")
    d = Kvtierd(tmp_path / "kvtierd", config=conf)
    try:
        a = connect(d, name="acme")
        a.pool.write(0, pattern(70, 4096))
        assert a.batch_put(
            [a.transfer("shared", [(0, 4096)]), a.transfer("acme-only", [(0, 4096)])]
        ) == [OK, OK]
        r = subprocess.run(
            ["setpriv", "--regid", "65534", "--clear-groups", sys.executable, "-c", GLOBEX_CLIENT]
            + [d.mempool, d.grpc],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        g = json.loads(r.stdout)
        # Globex sees none of acme's objects, stores its own under the same id, reads it back.
        assert g["seen"] == [False, False]
        assert g["put"] == [OK, OK] and g["got"] == [OK]
        assert bytes.fromhex(g["bytes"]) == bytes([7]) * 4096
        # Acme still reads its own bytes under the shared id and never sees globex's.
        a.pool.write(0, bytes(4096))
        assert a.batch_get([a.transfer("shared", [(0, 4096)])]) == [OK]
        assert a.pool.read(0, 4096) == pattern(70, 4096)
        assert a.exist(["globex-only"]) == [False]
        # A client cannot claim another tenant: the relay drops the header it sends.
        req = rpc.pb2.ExistRequest(id=[b"globex-only"])
        claimed = a.stub.Exist(req, metadata=[("kvtier-peer-tenant", "globex")], timeout=30)
        assert list(claimed.results) == [False]
        # L3 holds four objects: each tenant's two.
        assert len(d.l3_files()) == 4
        a.close()
    finally:
        d.stop()
