"""The vLLM worker's three transfers (DMA, CPU staging, GPU staging) under the one rule of
reads.py, each against real kvtier-agent and kvtierd processes on CPU: what a step saves
loads back bit-identical into other blocks; a finished request is held while a save will
still read its blocks; and once a preemption gives up waiting, a save that had not read a
request's blocks never reads them, so the bytes vLLM writes into them next are never saved
under the old request's keys.

GPU staging gathers within the step on CPU tensors too (a synchronous copy instead of the
stream's); DMA runs over the KV cache in shared memory, the agent reading it in place (the
engine fuzzer's stand-in for a GPU's DMA)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.agent import AgentClient
from kvtier.integrations.vllm.blocks import block_bytes, storage_bytes
from kvtier.integrations.vllm.common import Counts, Job, Settings
from kvtier.integrations.vllm.reads import BlockReads
from kvtier.integrations.vllm.staged import CpuStaging, GpuStaging, StagedTransfer
from kvtier.integrations.vllm.stats import Tally
from kvtier.integrations.vllm.transfer import SETTLE_CALL_S, DmaTransfer, KvBlocks, Transfer
from kvtier.keys import Namespace
from kvtier.layout import LayoutSpec, State

BLOCKS, BS, HEADS, HEAD, LAYERS = 16, 4, 2, 8, 2
KINDS = {"dma": DmaTransfer, "cpu_staging": CpuStaging, "gpu_staging": GpuStaging}
# Whether the kind's saves read the blocks after the step (and so hold and give up).
READS_AFTER_STEP = {"dma": True, "cpu_staging": True, "gpu_staging": False}
TIMEOUT_S = 0.3


def kv_blocks(kind: str) -> KvBlocks:
    g = torch.Generator().manual_seed(7)
    tensors = []
    for _ in range(LAYERS):
        t = torch.randint(-30000, 30000, (BLOCKS, 2, BS, HEADS, HEAD), generator=g)
        t = t.to(torch.int16).view(torch.bfloat16)
        if kind == "dma":
            t.share_memory_()
        tensors.append(t)
    geometry = [block_bytes(f"layer.{i}", t, BLOCKS) for i, t in enumerate(tensors)]
    size = geometry[0].block_bytes
    return KvBlocks(
        tensors=tensors,
        geometry=geometry,
        layers=[x.view(storage_bytes(t)) for x, t in zip(geometry, tensors, strict=True)],
        block_bytes=size,
        block_size=BS,
        num_blocks=BLOCKS,
        descriptor=LayoutSpec(
            model_id=f"transfers-{kind}",
            model_version="",
            dtype="uint8",
            num_layers=LAYERS,
            page_size=BS,
            shape=State(size // BS),
        ).descriptor(),
    )


@pytest.fixture(params=list(KINDS))
def transfer(request: pytest.FixtureRequest, agent) -> Iterator[Transfer]:
    kind: str = request.param
    settings = Settings(timeout_s=TIMEOUT_S, staging_pages=8)
    tally = Tally(Counts())
    client = AgentClient(agent.socket)
    t = KINDS[kind](kv_blocks(kind), client, settings, tally, BlockReads(TIMEOUT_S, tally))
    t.register()
    deadline = time.monotonic() + 10
    while not client.stats().daemon_connected:
        assert time.monotonic() < deadline, "the agent never connected to kvtierd"
        time.sleep(0.05)
    yield t
    t.reads.drain(10)
    t.shutdown()
    client.close()


def job(req: str, seed: int, blocks: list[int]) -> Job:
    tokens = [(seed * 1000 + i) % 50000 for i in range(len(blocks) * BS)]
    return Job(req, tokens, Namespace(tenant="transfers"), 0, blocks)


def block(t: Transfer, b: int) -> list[bytes]:
    return [layer[b].contiguous().numpy().tobytes() for layer in t.kv.layers]


def poison(t: Transfer, blocks: list[int]) -> None:
    for layer in t.kv.layers:
        for b in blocks:
            layer[b].fill_(0xA5)


def load_back(t: Transfer, seed: int, into: list[int]) -> list[int]:
    """Loads ``seed``'s prompt into ``into``; the blocks it filled."""
    t.tally.take_load_errors()
    t.load(job("reader", seed, into))
    missed = t.tally.take_load_errors()
    return [b for b in into if b not in missed]


def test_a_save_loads_back_bit_identical(transfer: Transfer) -> None:
    t = transfer
    want = [block(t, b) for b in (0, 1, 2, 3)]
    t.save([job("a", 1, [0, 1, 2, 3])])
    assert t.reads.drain(10)
    assert t.tally.counts.saved_pages == 4, t.tally.counts
    assert load_back(t, 1, [8, 9, 10, 11]) == [8, 9, 10, 11]
    assert [block(t, b) for b in (8, 9, 10, 11)] == want


def test_a_finished_request_is_held_while_a_save_will_read_its_blocks(
    transfer: Transfer, request: pytest.FixtureRequest
) -> None:
    t = transfer
    kind = request.node.callspec.params["transfer"]
    gate = threading.Event()
    # The save thread is busy: the step's save waits behind it.
    t._savers.submit(gate.wait, 10)
    t.save([job("a", 2, [0, 1])])
    held = not t.reads.unread({"a"})
    gate.set()
    assert t.reads.drain(10)
    assert held == READS_AFTER_STEP[kind]
    assert t.reads.unread({"a"}) == {"a"}


def test_a_preempted_requests_blocks_are_never_read_once_the_wait_gave_up(
    transfer: Transfer, request: pytest.FixtureRequest
) -> None:
    t = transfer
    kind = request.node.callspec.params["transfer"]
    want = [block(t, b) for b in (0, 1, 2, 3)]
    gate = threading.Event()
    t._savers.submit(gate.wait, 10)
    t.save([job("a", 3, [0, 1, 2, 3])])
    started = time.monotonic()
    t.reads.give_up(["a"], t.stop_reading)
    waited = time.monotonic() - started
    # vLLM reuses the blocks for another request at once.
    poison(t, [0, 1, 2, 3])
    gate.set()
    assert t.reads.drain(10)
    got = load_back(t, 3, [8, 9, 10, 11])
    # Whatever was saved under the request's keys is the request's, never what vLLM wrote
    # into the blocks after the give-up.
    assert [block(t, b) for b in got] == want[: len(got)], "a page saved over reused blocks"
    c = t.tally.counts
    if READS_AFTER_STEP[kind]:
        # It waited out the deadline, then the save skipped the request: nothing stored.
        assert waited >= TIMEOUT_S + 1.0 - 0.05
        assert c.save_preempted_pages == 4 and c.saved_pages == 0, c
        assert got == []
    else:
        # Read within the step: nothing to wait for, and what was saved is the request's.
        assert waited < TIMEOUT_S
        assert c.saved_pages == 4 and c.save_preempted_pages == 0, c
        assert got == [8, 9, 10, 11]


def test_a_later_batch_of_a_resumed_request_is_saved(transfer: Transfer) -> None:
    """Giving up covers the batches queued before it, not the resumed request's own."""
    t = transfer
    gate = threading.Event()
    t._savers.submit(gate.wait, 10)
    t.save([job("a", 4, [0, 1])])
    t.reads.give_up(["a"], t.stop_reading)
    want = [block(t, b) for b in (4, 5)]
    t.save([job("a", 5, [4, 5])])
    gate.set()
    assert t.reads.drain(10)
    assert load_back(t, 5, [12, 13]) == [12, 13]
    assert [block(t, b) for b in (12, 13)] == want


@pytest.mark.parametrize("transfer", ["cpu_staging", "gpu_staging"], indirect=True)
def test_every_piece_of_a_load_names_the_whole_load(transfer: Transfer) -> None:
    """A load larger than half the staging pool goes in pieces; each piece names the whole
    load's size, so kvtierd judges load versus recompute once for the load (a short last
    piece, all latency, would be refused on its own after the pieces before it loaded)."""
    t = transfer
    want = [block(t, b) for b in range(6)]
    t.save([job("a", 6, list(range(6)))])
    assert t.reads.drain(10)
    asked: list[tuple[int, int]] = []
    real = t.agent.load_pages

    def load_pages(*a, **k):  # the real call, its arguments noted
        asked.append((len(a[3]), k["whole_load_pages"]))
        return real(*a, **k)

    t.agent.load_pages = load_pages  # type: ignore[method-assign]
    # 8 staging pages: pieces of at most 4.
    assert load_back(t, 6, list(range(6, 12))) == list(range(6, 12))
    assert asked == [(4, 6), (2, 6)]
    assert [block(t, b) for b in range(6, 12)] == want
    asked.clear()
    assert load_back(t, 6, [12, 13, 14]) == [12, 13, 14]
    assert asked == [(3, 0)], "a load in one piece is the whole load"
    # A load the busy pool splits (other transfers hold 6 of its 8 pages) names its whole
    # size too (a review finding: its pieces were judged alone).
    asked.clear()
    assert isinstance(t, StagedTransfer) and t._staging is not None
    held = t._staging.take(6)
    try:
        assert load_back(t, 6, [12, 13, 14]) == [12, 13, 14]
    finally:
        t._staging.give(held)
    assert asked == [(2, 3), (1, 3)]


def test_blocks_a_failed_load_gave_back_are_never_written_after(
    transfer: Transfer, agent, request: pytest.FixtureRequest
) -> None:
    """The agent stops (SIGSTOP: a descheduled copy thread, a CPU-quota pause) while a load
    is out, and its deadline passes. Once ``load`` returns, the blocks are vLLM's to give to
    another request: the agent must never write into them after. Staging loads land in the
    staging pool, which the failed call retires, so they return at the deadline; a DMA load
    writes into vLLM's blocks itself, so it returns only once the agent's Cancel says its
    copies stopped, after the agent runs again (a copy part it was in the middle of would
    otherwise land in the next owner's blocks). (A staging load may wait for the agent too:
    the pool that replaces the retired one is registered with it.)"""
    t = transfer
    kind = request.node.callspec.params["transfer"]
    blocks = [0, 1, 2, 3]
    t.save([job("a", 7, blocks)])
    assert t.reads.drain(10)
    into = [8, 9, 10, 11]
    done = threading.Event()
    missed: list[int] = []

    def run() -> None:
        t.tally.take_load_errors()
        t.load(job("reader", 7, into))
        missed.extend(t.tally.take_load_errors())
        done.set()

    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        threading.Thread(target=run, daemon=True).start()
        # Stopped past the deadline and a whole Cancel's wait (SETTLE_CALL_S).
        returned_while_stopped = done.wait(TIMEOUT_S + SETTLE_CALL_S + 2.0)
    finally:
        if returned_while_stopped:
            # vLLM hands the blocks to another request, which writes them, before the agent
            # runs again.
            poison(t, into)
        os.kill(agent.proc.pid, signal.SIGCONT)
    if kind == "dma":
        assert not returned_while_stopped, "a DMA load gave its blocks back mid-copy"
    assert done.wait(10), "the load never returned once the agent ran again"
    if not returned_while_stopped:
        # It returned once the agent ran again: vLLM gets the blocks now.
        poison(t, into)
    if kind == "dma":
        assert sorted(missed) == into
    else:
        # A staging load that waited for its pool's replacement may load once the agent
        # runs again: all of it or none.
        assert sorted(missed) in (into, []), missed
    time.sleep(0.5)
    for b in into:
        assert all(set(layer) == {0xA5} for layer in block(t, b)), f"block {b} written after"
    assert t.tally.counts.load_settle_waits == (1 if kind == "dma" else 0)


@pytest.mark.parametrize("transfer", ["dma"], indirect=True)
def test_a_failed_dma_load_is_given_back_once_its_agent_is_gone(transfer: Transfer, agent) -> None:
    """An agent killed while a DMA load is out copies nothing more: the load returns once
    nothing listens at the agent's socket, without waiting for a Cancel that cannot come."""
    t = transfer
    os.kill(agent.proc.pid, signal.SIGSTOP)
    done = threading.Event()

    def run() -> None:
        t.load(job("reader", 8, [8, 9]))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert not done.wait(TIMEOUT_S + 2.0)
    agent.proc.kill()
    agent.proc.wait()
    assert done.wait(10), "a load waited on a dead agent"
    assert sorted(t.tally.take_load_errors()) == [8, 9]


def test_a_failed_dma_loads_settle_is_decided_by_how_the_agent_answers() -> None:
    """Without a process (the decision alone): a Cancel answered settles at once; one turned
    down (an agent that lost this worker's registration, an older one without Cancel: it
    runs, so the failed call's last copy part ends within SETTLE_PART_S) after that bound;
    one not answered is asked again while something listens at the agent's address, and
    settles once nothing does."""
    import grpc

    from kvtier.host import KvtierError
    from kvtier.integrations.vllm.transfer import SETTLE_PART_S

    class Agent:
        def __init__(self, answers: list[KvtierError | None], listening: list[bool]):
            self.answers, self.listens, self.cancels = answers, listening, 0

        def cancel(self, ids: list[str], owner: str | None = None, timeout: float = 0) -> int:
            self.cancels += 1
            answer = self.answers.pop(0)
            if answer is not None:
                raise answer
            return 1

        def listening(self) -> bool:
            return self.listens.pop(0)

    lost = KvtierError("no pool", grpc.StatusCode.NOT_FOUND, lost="pool")
    old = KvtierError("no such method", grpc.StatusCode.UNIMPLEMENTED)
    late = KvtierError("deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
    cases = [
        ([None], [], 1, 0.0),
        # Answered, though not with a Cancel (review: a restarted agent's "pool lost" was
        # asked again forever).
        ([lost], [], 1, SETTLE_PART_S),
        ([old], [], 1, SETTLE_PART_S),
        ([late, late, None], [True, True], 3, 0.0),
        ([late, late], [True, False], 2, 0.0),
    ]
    for answers, listening, cancels, at_least in cases:
        tally = Tally(Counts())
        agent = Agent(list(answers), list(listening))
        t = DmaTransfer(kv_blocks("dma"), agent, Settings(), tally, BlockReads(1.0, tally))  # type: ignore[arg-type]
        started = time.monotonic()
        t._settle("call", "owner", job("r", 1, [0]))
        took = time.monotonic() - started
        assert agent.cancels == cancels and not agent.answers, answers
        assert at_least <= took < at_least + 1.5, (answers, took)
        assert tally.counts.load_settle_waits == (1 if late in answers else 0)
        t.shutdown()


@pytest.mark.parametrize("transfer", ["dma"], indirect=True)
def test_a_failed_dma_load_returns_once_a_restarted_agent_answers(
    transfer: Transfer, agent, kvtierd, tmp_path
) -> None:
    """The agent a DMA load was out to is stopped, then replaced on its socket by a new one
    that knows nothing of the worker's registration: every Cancel is answered "pool lost".
    The answer says a running agent holds the socket, so the load returns (review: it asked
    again forever, and the worker's shutdown hung behind it)."""
    from kvtier.testing.processes import Agent

    t = transfer
    done = threading.Event()

    def run() -> None:
        t.load(job("reader", 9, [8, 9]))
        done.set()

    os.kill(agent.proc.pid, signal.SIGSTOP)
    threading.Thread(target=run, daemon=True).start()
    assert not done.wait(TIMEOUT_S + 1.0)
    (tmp_path / "new").mkdir()
    new = Agent(tmp_path / "new", "agent", kvtierd.socket)
    try:
        os.replace(new.socket, agent.socket)
        agent.proc.kill()
        agent.proc.wait()
        assert done.wait(15), "the load never returned to a restarted agent's answers"
        assert sorted(t.tally.take_load_errors()) == [8, 9]
    finally:
        new.proc.kill()
        new.proc.wait()
