"""The vLLM scheduler side's lookup threads: a queued lookup's result or error reaches its
PendingLookup before ``done`` is set; one lookup that hangs holds up no other; a lookup the
scheduler gave up on before a thread took it is never sent; shutdown sends nothing queued."""

from __future__ import annotations

import threading
import time

from kvtier.host import KvtierError
from kvtier.integrations.vllm.lookups import LookupThreads, PendingLookup


def wait_done(p: PendingLookup, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not p.done:
        assert time.monotonic() < deadline, "a lookup never came back"
        time.sleep(0.001)


def test_result_and_error_reach_the_pending_lookup() -> None:
    threads = LookupThreads(2, "test-lookup")
    ok: PendingLookup[int] = PendingLookup(0, 4, time.monotonic())
    bad: PendingLookup[int] = PendingLookup(0, 4, time.monotonic())

    def fail() -> int:
        raise KvtierError("Lookup: UNAVAILABLE: agent gone")

    threads.submit(ok, lambda a, b: a + b, 2, 3)
    threads.submit(bad, fail)
    wait_done(ok)
    wait_done(bad)
    assert ok.result == 5 and ok.error is None
    assert isinstance(bad.error, KvtierError) and "agent gone" in str(bad.error)
    assert bad.result is None
    threads.shutdown()


def test_a_hung_lookup_holds_up_no_other() -> None:
    threads = LookupThreads(4, "test-lookup")
    gate = threading.Event()
    hung: PendingLookup[str] = PendingLookup(0, 4, time.monotonic())
    threads.submit(hung, lambda: "late" if gate.wait(10) else "never")
    quick = [PendingLookup(0, 4, time.monotonic()) for _ in range(8)]
    for i, p in enumerate(quick):
        threads.submit(p, lambda i=i: i)
    for p in quick:
        wait_done(p)
    assert [p.result for p in quick] == list(range(8))
    assert not hung.done
    gate.set()
    wait_done(hung)
    assert hung.result == "late"
    threads.shutdown()


def test_dropped_and_queued_lookups_are_never_sent() -> None:
    threads = LookupThreads(1, "test-lookup")
    gate = threading.Event()
    sent: list[str] = []
    busy: PendingLookup[None] = PendingLookup(0, 4, time.monotonic())
    threads.submit(busy, lambda: sent.append("busy") or gate.wait(10) and None)
    dropped: PendingLookup[None] = PendingLookup(0, 4, time.monotonic())
    threads.submit(dropped, lambda: sent.append("dropped"))
    dropped.dropped = True
    kept: PendingLookup[None] = PendingLookup(0, 4, time.monotonic())
    threads.submit(kept, lambda: sent.append("kept"))
    wait_done_or_sent = time.monotonic() + 5
    while "busy" not in sent:
        assert time.monotonic() < wait_done_or_sent
        time.sleep(0.001)
    threads.shutdown()
    gate.set()
    wait_done(busy)
    time.sleep(0.05)
    assert sent == ["busy"], "a dropped or queued lookup was sent"
    assert kept.dropped and not kept.done
