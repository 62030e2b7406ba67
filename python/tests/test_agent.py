"""kvtier.agent against real kvtier-agent and kvtierd processes, this test as the engine with
a CPU KV pool: insert, match, evict (backed up to L2), load back bit-identical, and bad input
refused by name."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import grpc
import pytest

from kvtier import _memory_door, _pool_door
from kvtier._memory_door import memfd
from kvtier.agent import MAX_SAVE_BATCH, After, AgentClient, PagePiece, SaveItem, packed
from kvtier.host import DaemonClient, KvtierError
from kvtier.keys import Namespace, page_keys
from kvtier.testing import Agent, Kvtierd
from kvtier.testing.layouts import tiny_layout
from kvtier.testing.old_servers import BareNotFound
from kvtier.v1 import agent_pb2, common_pb2

LAYERS, PAGE, SLOTS, TOKEN_BYTES = 2, 4, 64, 16  # 1 KV head of 8 bf16
BUFFERS = 2 * LAYERS  # K of each layer, then V of each layer
RUN = PAGE * TOKEN_BYTES


def layout() -> common_pb2.LayoutDescriptor:
    return tiny_layout(PAGE, model_id="agent-test", num_layers=LAYERS)


class CpuPool:
    """The engine's KV pool: layer-first buffers end to end in a memfd, handed to the agent
    as its descriptor."""

    SIZE = BUFFERS * SLOTS * TOKEN_BYTES

    def __init__(self, size: int = SIZE):
        self.fd = memfd("kvtier-test-engine", size)
        self.size = size

    def page(self, p: int) -> bytes:
        data = os.pread(self.fd, self.size, 0)
        return b"".join(data[b * SLOTS * TOKEN_BYTES + p * RUN :][:RUN] for b in range(BUFFERS))

    def fill(self, p: int, seed: int) -> bytes:
        for b in range(BUFFERS):
            data = bytes((seed * 31 + b * 7 + i) % 251 for i in range(RUN))
            os.pwrite(self.fd, data, b * SLOTS * TOKEN_BYTES + p * RUN)
        return self.page(p)

    def clear(self) -> None:
        os.pwrite(self.fd, bytes(self.size), 0)

    def read(self) -> bytes:
        return os.pread(self.fd, self.size, 0)


@pytest.fixture
def engine(agent):
    c = AgentClient(agent.socket)
    pool = CpuPool()
    info = c.register_pool(layout(), SLOTS, cpu_fd=pool.fd)
    assert info.num_pages == SLOTS // PAGE
    # The agent opens its kvtierd session for the registered layout in the background.
    deadline = time.monotonic() + 10
    while not c.stats().daemon_connected:
        assert time.monotonic() < deadline, "the agent never connected to kvtierd"
        time.sleep(0.05)
    yield c, pool
    c.close()


def test_pages_go_to_l2_on_eviction_and_load_back_identical(engine) -> None:
    c, pool = engine
    tokens = list(range(1, 3 * PAGE + 1))
    m = c.match(tokens)
    assert (m.device_pages, m.total_pages) == ([], 3)
    want = [pool.fill(p, seed=p + 1) for p in range(3)]
    assert c.insert(tokens, [0, 1, 2]).inserted == 3
    c.release(m.handle)
    m = c.match(tokens)
    assert m.device_pages == [0, 1, 2]
    c.release(m.handle)

    ev = c.evict(SLOTS // PAGE)
    assert set(ev.pages) >= {0, 1, 2} and ev.backed_up >= 3 and ev.lost == 0
    pool.clear()
    m = c.match(tokens)
    assert (m.device_pages, m.l2_pages) == ([], 3)
    lb = c.load_back(m.handle, [5, 6, 7, 8])
    assert (lb.loaded, lb.device_pages, lb.unused_pages) == (3, [5, 6, 7], [8])
    assert [pool.page(p) for p in (5, 6, 7)] == want
    c.release_batch([m.handle])
    s = c.stats()
    assert s.pool_registered and s.open_handles == 0 and s.lost_pages == 0


def test_bad_input_is_refused_by_name(engine) -> None:
    c, _ = engine
    with pytest.raises(KvtierError) as e:
        c.insert(list(range(PAGE)), [SLOTS])  # a page past the pool
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="policy"):
        c.prefetch(1, policy="soon")
    with pytest.raises(ValueError, match="exactly one"):
        c.register_pool(layout(), SLOTS)


def test_a_cuda_pool_map_is_checked_by_field_before_any_handle_is_opened(agent) -> None:
    """vLLM's layouts register one IPC handle per allocation with a page's pieces placed in
    it; a map that runs past its allocation or overlaps itself is refused naming the piece,
    on any machine (the GPU is only touched once the map is sound)."""
    c = AgentClient(agent.socket)
    pages = SLOTS // PAGE
    pieces = [PagePiece(0, b * pages * RUN, RUN, RUN) for b in range(BUFFERS)]
    whole = BUFFERS * pages * RUN
    handle = [bytes(64)]
    with pytest.raises(KvtierError) as e:
        c.register_pool(
            layout(), SLOTS, cuda_ordinal=0, cuda_ipc_handles=handle,
            allocation_bytes=[whole - 1], pieces=pieces,
        )  # fmt: skip
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"cuda.pieces[{BUFFERS - 1}]" in str(e.value)
    overlapping = [*pieces[:2], PagePiece(0, pieces[1].offset + RUN, RUN, RUN), *pieces[3:]]
    with pytest.raises(KvtierError) as e:
        c.register_pool(
            layout(), SLOTS, cuda_ordinal=0, cuda_ipc_handles=handle,
            allocation_bytes=[whole], pieces=overlapping,
        )  # fmt: skip
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "overlaps pieces[1]" in str(e.value)
    c.close()


def test_packed_tokens_are_little_endian_u32s_and_refuse_what_does_not_fit():
    assert packed([1, 0x01020304, 2**32 - 1]) == bytes([1, 0, 0, 0, 4, 3, 2, 1, 255, 255, 255, 255])
    assert packed([]) == b""
    with pytest.raises(ValueError, match="tokens"):
        packed([2**32])
    with pytest.raises(ValueError, match="tokens"):
        packed([-1])
    # Long prompts are packed in chunks (the GIL changes hands between them): the same bytes,
    # from a list, a tuple, or any sequence that slices; a bad token in a later chunk is
    # refused all the same.
    long = [(i * 2_654_435_761) % 2**32 for i in range(3 * 4096 + 17)]
    want = struct.pack(f"<{len(long)}I", *long)
    assert packed(long) == packed(tuple(long)) == want
    with pytest.raises(ValueError, match="tokens"):
        packed(long + [2**32])


_REGISTER = """
import sys
from kvtier.agent import AgentClient
from kvtier.host import KvtierError
from test_agent import CpuPool, layout, SLOTS
c = AgentClient({socket!r})
try:
    c.register_pool(layout(), SLOTS, cpu_fd=CpuPool().fd)
except KvtierError as e:
    print("taken" if e.pool_taken else "other", e)
    sys.exit(3)
print("registered")
"""


def _register_from_another_process(socket: str) -> tuple[int, str]:
    import subprocess
    import sys

    code = _REGISTER.format(socket=socket)
    # Run beside this file (``-c`` puts the working directory first on the path): the child
    # imports the pool and layout from this module.
    here = Path(__file__).parent
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=here
    )
    return r.returncode, r.stdout + r.stderr[-2000:]


def test_a_pool_belongs_to_the_client_that_registered_it(engine, agent) -> None:
    c, pool = engine
    tokens = list(range(1, 2 * PAGE + 1))
    pool.fill(0, seed=1)
    assert c.insert(tokens[:PAGE], [0]).inserted == 1
    # Another live process (a second worker sent to this agent) is refused, with the owner
    # named; the owner's pool and tree are untouched.
    rc, out = _register_from_another_process(agent.socket)
    assert rc == 3 and out.startswith("taken"), out
    assert f"pid {os.getpid()}" in out, out
    m = c.match(tokens)
    assert m.device_pages == [0]
    c.release(m.handle)
    # A client that did not register (no owner token) is served nothing of the pool.
    stranger = AgentClient(agent.socket)
    with pytest.raises(KvtierError) as e:
        stranger.match(tokens)
    assert e.value.pool_lost and not e.value.session_lost
    assert "kvtier-pool-owner" in str(e.value)
    stranger.close()
    # The owner registering again (a new pool, same process) gets a new token: a call
    # with the old one is refused, never served against the new pool.
    old = list(c._owner)
    c.register_pool(layout(), SLOTS, cpu_fd=pool.fd)
    assert c._owner != old
    stale = AgentClient(agent.socket)
    stale._owner = old
    with pytest.raises(KvtierError) as e:
        stale.match(tokens)
    assert e.value.pool_lost
    stale.close()
    assert c.match(tokens).device_pages == []  # the tree started over with the new pool


def test_a_pool_whose_owner_exited_can_be_registered_again(agent) -> None:
    rc, out = _register_from_another_process(agent.socket)
    assert rc == 0, out
    # Its owner process is gone: the next worker takes the agent over.
    c = AgentClient(agent.socket)
    info = c.register_pool(layout(), SLOTS, cpu_fd=CpuPool().fd)
    assert info.num_pages == SLOTS // PAGE
    assert c.stats().pool_registered
    c.close()


def _engine_cache(agent) -> tuple[AgentClient, CpuPool]:
    """A client with a CPU pool registered in engine-cache mode, once the agent has its
    kvtierd session."""
    c = AgentClient(agent.socket)
    pool = CpuPool()
    c.register_pool(layout(), SLOTS, cpu_fd=pool.fd, engine_cache=True)
    deadline = time.monotonic() + 10
    while not c.stats().daemon_connected:
        assert time.monotonic() < deadline, "the agent never connected to kvtierd"
        time.sleep(0.05)
    return c, pool


def test_engine_cache_calls_after_a_parent_key_carry_only_their_pages(agent, tmp_path) -> None:
    """Engine-cache mode (vLLM): the first lookup sends the prompt and brings back its page
    keys; saves and loads then name their pages by the key before them (``After``) and
    carry only their own tokens, and what loads is what was saved."""
    c, pool = _engine_cache(agent)
    tokens = list(range(500, 500 + 6 * PAGE + 1))
    ns = Namespace(tenant="after")
    found = c.lookup_pages(tokens, ns, 0, want_keys=True)
    assert (found.l2_pages, found.total_pages) == (0, 6)
    keys = found.keys()
    assert keys == page_keys(tokens, PAGE, ns)
    want = [pool.fill(p, seed=p + 40) for p in range(6)]
    # Pages 0..2 from the start, 2..6 after page 1's key.
    assert c.save_pages(tokens[: 2 * PAGE], ns, 0, [0, 1]).stored == 2
    saved = c.save_pages(After(keys[1], tokens[2 * PAGE :]), ns, 2, [2, 3, 4, 5])
    assert (saved.stored, saved.failed) == (4, 0)
    found = c.lookup_pages(After(keys[2], tokens[3 * PAGE :]), ns, 3, want_keys=True)
    assert (found.l2_pages, found.total_pages) == (3, 6)
    assert found.keys() == keys[3:]
    pool.clear()
    loaded = c.load_pages(After(keys[0], tokens[PAGE:]), ns, 1, [10, 11, 12, 13, 14])
    assert loaded.pages == 5
    # The last page's key: what a Load of the pages after it names as their parent.
    assert loaded.last_key == keys[5]
    assert [pool.page(p) for p in (10, 11, 12, 13, 14)] == want[1:]
    # A parent key of the wrong length is refused by name.
    with pytest.raises(KvtierError, match="parent_key") as e:
        c.lookup_pages(After(b"\x01" * 31, tokens[PAGE:]), ns, 1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.refused
    c.close()


def test_a_save_batch_saves_each_request_and_a_bad_one_refuses_it_all(agent, tmp_path) -> None:
    """One SaveBatch per engine step: each request's pages reach L2 and load back as saved,
    answers come in request order, and a malformed request refuses the whole call by name
    before any page moves."""
    c, pool = _engine_cache(agent)
    ns = Namespace(tenant="batch")
    prompts = [list(range(1000 * i, 1000 * i + 3 * PAGE)) for i in range(1, 4)]
    want = [pool.fill(p, seed=p + 70) for p in range(9)]
    keys0 = page_keys(prompts[0], PAGE, ns)
    items = [SaveItem(t, ns, 0, [3 * i, 3 * i + 1]) for i, t in enumerate(prompts)]
    # Prompt 0's third page continues its first request, named after its page 1.
    items.append(SaveItem(After(keys0[1], prompts[0][2 * PAGE :]), ns, 2, [2]))
    saved = c.save_batch(items)
    assert [(s.stored, s.failed) for s in saved] == [(2, 0), (2, 0), (2, 0), (1, 0)]
    assert c.save_batch([]) == []
    pool.clear()
    assert c.load_pages(prompts[0], ns, 0, [9, 10, 11]).pages == 3
    assert [pool.page(p) for p in (9, 10, 11)] == want[0:3]
    assert c.load_pages(prompts[2][: 2 * PAGE], ns, 0, [12, 13]).pages == 2
    assert [pool.page(p) for p in (12, 13)] == want[6:8]
    # A page outside the pool in the second request: refused whole, naming it.
    fresh = list(range(90_000, 90_000 + 2 * PAGE))
    good = SaveItem(fresh, ns, 0, [14, 15])
    with pytest.raises(KvtierError, match=r"requests\[1\]\.device_pages") as e:
        c.save_batch([good, SaveItem(fresh, ns, 0, [14, SLOTS + 5])])
    assert e.value.invalid_input
    assert c.lookup_pages(fresh, ns, 0).l2_pages == 0
    # More than one call's worth goes in parts, an answer for each: the pages copied once,
    # found present by every other request.
    many = c.save_batch([good] * (MAX_SAVE_BATCH + 1))
    assert len(many) == MAX_SAVE_BATCH + 1
    assert sum(s.stored for s in many) == 2
    assert all(s.stored + s.present == 2 and s.failed == 0 for s in many)
    c.close()


def test_a_call_named_by_id_is_cancelled_even_when_the_cancel_arrives_first(
    agent, tmp_path
) -> None:
    """``cancel`` stops the client's calls it names (the agent answers once their copies
    stopped). A Cancel may reach the agent before the call it names; that call, arriving
    under the cancelled id, copies and stores nothing, and its pages are counted failed."""
    c, pool = _engine_cache(agent)
    ns = Namespace(tenant="cancel")
    prompt = list(range(7000, 7000 + 3 * PAGE))
    for p in range(3):
        pool.fill(p, seed=p + 90)
    assert c.cancel(["save-1"]) == 0  # nothing runs under it yet
    saved = c.save_batch([SaveItem(prompt, ns, 0, [0, 1, 2])], call_id="save-1")
    assert [(s.stored, s.present) for s in saved] == [(0, 0)], saved
    assert c.lookup_pages(prompt, ns, 0).l2_pages == 0
    # Another id runs as usual; the same call later under its own id is not cancelled.
    saved = c.save_batch([SaveItem(prompt, ns, 0, [0, 1, 2])], call_id="save-2")
    assert saved[0].stored == 3
    pool.clear()
    assert c.load_pages(prompt, ns, 0, [4, 5, 6], call_id="load-1").pages == 3
    c.cancel(["load-2"])
    pool.clear()
    assert c.load_pages(prompt, ns, 0, [4, 5, 6], call_id="load-2").pages == 0
    assert [pool.page(p) for p in (4, 5, 6)] == [bytes(BUFFERS * RUN)] * 3
    # Bad ids are refused by name.
    with pytest.raises(KvtierError, match=r"call_ids\[1\]") as e:
        c.cancel(["ok", "not ok"])
    assert e.value.invalid_input
    with pytest.raises(KvtierError, match="kvtier-call-id") as e:
        c.load_pages(prompt, ns, 0, [4], call_id="x" * 65)
    assert e.value.invalid_input
    # Only the registered pool's owner cancels: a token of an earlier registration names
    # calls that may have been retried under the new one (found by the break-it review).
    old = c.register_pool(layout(), SLOTS, cpu_fd=pool.fd, engine_cache=True).owner
    c.register_pool(layout(), SLOTS, cpu_fd=pool.fd, engine_cache=True)
    with pytest.raises(KvtierError) as e:
        c.cancel(["save-3"], owner=old)
    assert e.value.pool_lost
    c.close()


def test_an_engine_cannot_hand_the_agent_its_own_l2_pool_as_its_memory(
    tmp_path, monkeypatch
) -> None:
    """Review finding (issue 61): a client that registered ``/proc/self/fd/N`` (resolved in
    the agent, so the agent's own descriptors) as its allocation got the agent's mapping of
    the node's L2 pool as its "device pages", and read another tenant's pages through it.
    The agent opens no path now (issue 62), and the one way left to name its L2 pool, the
    pool's own descriptor (which kvtierd's pool door gives a session of the same tenant),
    is refused by field: the engine's memory and L2 must be distinct mappings."""
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=64")
    a = Agent(tmp_path, "agent", d.socket)
    try:
        pb = BUFFERS * RUN
        pieces = [PagePiece(0, i * RUN, pb, RUN) for i in range(BUFFERS)]
        c = AgentClient(a.socket, timeout=10)
        own = CpuPool()
        c.register_pool(layout(), SLOTS, cpu_fd=own.fd, engine_cache=True)
        _wait_linked(c)
        # The same layout and tenant as the agent's session: the door hands this test the
        # very pool the agent maps (kept here: the session closes its own descriptor).
        kept: list[tuple[int, int, int]] = []
        fetch = _pool_door.fetch

        def keep(path: str, session_id: bytes, timeout: float) -> tuple[int, int, int]:
            fd, slots, stride = fetch(path, session_id, timeout)
            kept.append((os.dup(fd), slots, stride))
            return fd, slots, stride

        monkeypatch.setattr(_pool_door, "fetch", keep)
        host = DaemonClient(d.socket)
        host.register("thief", layout())
        (fd, slots, stride) = kept[0]
        try:
            n = slots * stride // pb
            with pytest.raises(KvtierError, match=r"cpu\.memory\[0\]: is the agent's own L2"):
                c.register_pool(
                    layout(), n * PAGE, cpu_allocation_fds=[fd], allocation_bytes=[n * pb],
                    pieces=pieces, engine_cache=True,
                )  # fmt: skip
        finally:
            os.close(fd)
            host.close()
        c.close()
    finally:
        a.stop()
        d.stop()


def test_the_agent_opens_no_path_and_keeps_descriptors_for_their_own_uid(agent) -> None:
    """The wire has no path to name (``CpuPool.path`` is reserved: an old client's path is
    dropped, and the request refused for want of memory); a ticket serves one registration;
    a descriptor that is not a regular file is refused at the door."""
    c = AgentClient(agent.socket)
    req = agent_pb2.RegisterPoolRequest(layout=layout(), num_token_slots=SLOTS)
    assert "path" not in agent_pb2.CpuPool.DESCRIPTOR.fields_by_name
    req.cpu.CopyFrom(agent_pb2.CpuPool())
    with pytest.raises(KvtierError, match=r"cpu\.memory: required") as e:
        c._call(c.stub.RegisterPool, req)
    assert e.value.invalid_input
    door = c.stats().memory_socket
    pool = CpuPool()
    ticket = _memory_door.deposit(door, [pool.fd], 5)
    req.cpu.memory = ticket
    c._call(c.stub.RegisterPool, req)
    with pytest.raises(KvtierError, match="no deposit has this ticket"):
        c._call(c.stub.RegisterPool, req)
    r, w = os.pipe()
    try:
        with pytest.raises(KvtierError, match="not a regular file") as e:
            _memory_door.deposit(door, [pool.fd, r], 5)
        assert e.value.refused
    finally:
        os.close(r)
        os.close(w)
    c.close()


def _wait_linked(c: AgentClient) -> None:
    deadline = time.monotonic() + 10
    while not c.stats().daemon_connected and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_agents_not_found_without_the_trailer_is_a_lost_pool() -> None:
    """A newer Python package beside an older agent still registers again after the agent
    restarted: every NOT_FOUND an agent answers is of the caller's pool."""

    old_agent = BareNotFound("no KV pool is registered")
    c = AgentClient("/nonexistent/agent.sock")
    with pytest.raises(KvtierError) as e:
        c._call(old_agent.answer, agent_pb2.CancelRequest())
    assert e.value.pool_lost and not e.value.session_lost
    c.close()


def test_listening_tells_a_gone_agent_by_every_address_form(tmp_path) -> None:
    """``AgentClient.listening`` (a failed DMA load settles once nothing listens): every
    address form ``grpc_target`` accepts is probed at its socket (review: ``dns:`` and
    ``ipv4:`` forms read as listening when nothing was, and a ``dns:`` name without a port
    raised)."""
    import socket

    from kvtier._rpc import grpc_target
    from kvtier.agent import AgentClient, _socket_address

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    gone = [
        str(tmp_path / "no.sock"),
        f"unix:{tmp_path / 'no.sock'}",
        f"127.0.0.1:{port}",
        f"dns:127.0.0.1:{port}",
        f"dns:///127.0.0.1:{port}",
        f"ipv4:127.0.0.1:{port}",
    ]
    for address in gone:
        assert not AgentClient(address).listening(), address
    # Something listening, on both kinds of socket.
    with socket.socket(socket.AF_UNIX) as u, socket.socket() as t:
        u.bind(str(tmp_path / "yes.sock"))
        u.listen()
        t.bind(("127.0.0.1", 0))
        t.listen()
        assert AgentClient(str(tmp_path / "yes.sock")).listening()
        assert AgentClient(f"ipv4:127.0.0.1:{t.getsockname()[1]}").listening()
    # A form without a socket to probe counts as listening (the caller keeps asking).
    assert _socket_address(grpc_target("dns:agent-host")) is None
    assert AgentClient("dns:agent-host").listening()
