"""kvtier.host against a real kvtierd: stats, the admin service, the metrics watch, a session's
two-phase write and pinned read through the mapped pool, and refusals that name the field."""

from __future__ import annotations

import grpc
import pytest

from kvtier.host import DaemonClient, KvtierError
from kvtier.keys import page_keys
from kvtier.testing.layouts import tiny_layout
from kvtier.testing.old_servers import BareNotFound
from kvtier.v1 import common_pb2, host_pb2


@pytest.fixture
def client(kvtierd):
    c = DaemonClient(kvtierd.socket)
    yield c
    c.close()


def layout(**kw: object) -> common_pb2.LayoutDescriptor:
    return tiny_layout(4, **kw)


def test_stats_admin_and_metrics_watch(client: DaemonClient) -> None:
    assert client.stats().version
    assert client.backend_status().attached
    snap = next(iter(client.watch_metrics(interval_ms=100)))
    assert snap.seq == 1 and any(s.name.startswith("kvtier_") for s in snap.samples)


def test_a_page_written_through_the_pool_reads_back(client: DaemonClient) -> None:
    s = client.register("py-test", layout())
    try:
        keys = page_keys(list(range(12)), 4)
        assert s.lookup(keys) == (0, 0)
        res = s.reserve(keys)
        assert [st for st, _ in res] == [host_pb2.RESERVE_STATUS_RESERVED] * 3
        data = [bytes([i + 1]) * s.page_bytes for i in range(3)]
        for (_, slot), d in zip(res, data):
            s.pool.view(slot, s.page_bytes)[:] = d
        s.commit(keys)
        assert s.lookup(keys) == (3, 0)
        stray = page_keys(list(range(100, 104)), 4)
        assert s.lookup_each([keys[2], stray[0], keys[0]]) == [True, False, True]
        assert [st for st, _ in s.reserve(keys)] == [host_pb2.RESERVE_STATUS_PRESENT] * 3
        slots = s.acquire(keys)
        assert [bytes(s.pool.view(x, s.page_bytes)) for x in slots] == data
        s.release(keys)
        with pytest.raises(KvtierError):
            s.pool.address(s.pool.slots, 0, 1)
        # Keys travel packed; one of the wrong length is refused by name before it could
        # shift the keys after it, and nothing stored changes.
        with pytest.raises(KvtierError, match=r"keys\[1\]: a page key is 32 bytes, got 31"):
            s.acquire([keys[0], keys[1][:31], keys[2]])
        assert s.lookup(keys) == (3, 0)
    finally:
        s.close()


def test_a_state_pool_stores_bytes(client: DaemonClient) -> None:
    """A pool that is not attention KV (a recurrent state): pages of `elems` bytes."""
    d = common_pb2.LayoutDescriptor(
        model_id="m",
        model_version="sglang/mamba",
        dtype=common_pb2.DTYPE_UINT8,
        num_layers=1,
        page_size=1,
        tp_rank=1,
        tp_size=2,
    )
    d.state.CopyFrom(common_pb2.StateShape(elems=3360))
    s = client.register("py-state", d)
    try:
        assert s.page_bytes == 3360
        keys = page_keys(list(range(3)), 1)
        res = s.reserve(keys)
        for i, (_, slot) in enumerate(res):
            s.pool.view(slot, s.page_bytes)[:] = bytes([i + 7]) * s.page_bytes
        s.commit(keys)
        assert s.lookup_each(keys) == [True] * 3
    finally:
        s.close()


def test_refusals_name_what_is_wrong(client: DaemonClient) -> None:
    with pytest.raises(KvtierError, match="num_layers") as e:
        client.register("bad", layout(num_layers=0))
    assert not e.value.retryable
    s = client.register("ok", layout())
    s.close()
    with pytest.raises(KvtierError) as e:
        s.lookup(page_keys(list(range(4)), 4))
    # The NOT_FOUND's trailer says what is lost: the session, not an agent's pool.
    assert e.value.session_lost and not e.value.pool_lost
    # A prefetch that does not exist is NOT_FOUND too, but the session is fine.
    live = client.register("live", layout())
    with pytest.raises(KvtierError) as e:
        live.release_prefetch("no-such-request")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert not e.value.session_lost and not e.value.pool_lost
    live.close()


def test_the_pool_arrives_as_a_descriptor_and_the_door_refuses_a_stranger(
    client: DaemonClient, kvtierd
) -> None:
    """The pool is mapped from the descriptor kvtierd's pool door hands the session: the file
    it names cannot be opened by path by anyone else, and a session id the door does not
    know is refused by name (a ``refused`` error, never a mapping)."""
    import os
    import stat

    from kvtier import _pool_door

    s = client.register("py-door", layout())
    try:
        r = client.stats()
        assert r.pools, r
        # kvtierd's own directory: nobody but its uid may open a name in it.
        d = os.path.dirname(s.pool.path)
        assert os.path.basename(d) == f"kvtierd-{os.geteuid()}"
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        door = kvtierd.socket + ".pools"
        fd, slots, stride = _pool_door.fetch(door, s.session_id, 5.0)
        try:
            assert (slots, stride) == (s.pool.slots, s.pool.stride)
            assert os.fstat(fd).st_size == slots * stride
        finally:
            os.close(fd)
        with pytest.raises(KvtierError, match="unknown or expired") as e:
            _pool_door.fetch(door, bytes(s.session_id[:8]) + b"\0" * 16, 5.0)
        assert e.value.refused
        with pytest.raises(KvtierError) as e:
            _pool_door.fetch(door + ".missing", s.session_id, 5.0)
        assert e.value.retryable
    finally:
        s.close()


def test_a_heartbeats_not_found_without_the_trailer_is_a_lost_session() -> None:
    """Beside a kvtierd older than the trailer, a session it forgot is still seen as lost
    at the next heartbeat (not only after a whole lease): a heartbeat's only NOT_FOUND is of
    its session."""
    from types import SimpleNamespace

    from kvtier.host import HostSession

    old_daemon = BareNotFound("unknown session")
    s = HostSession.__new__(HostSession)
    s.client = SimpleNamespace(host=SimpleNamespace(Heartbeat=old_daemon.answer), timeout=1.0)  # type: ignore[assignment]
    s.session_id = b"x" * 16
    with pytest.raises(KvtierError) as e:
        s.heartbeat()
    assert e.value.session_lost and not e.value.pool_lost
