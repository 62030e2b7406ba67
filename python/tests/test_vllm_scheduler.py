"""The vLLM scheduler side's answers while a lookup is in flight, against an agent whose
answer is held back (a slow agent): a request with pages to look up waits for it ("ask
again", None), and one with nothing to look up (vLLM's own cache holds every full block)
is answered 0 at once on every call, never held back until the lookup's deadline."""

from __future__ import annotations

import threading
import time
import types

from kvtier.agent import Lookup
from kvtier.integrations.vllm.common import Counts, Settings
from kvtier.integrations.vllm.scheduler import SchedulerSide

BS = 16


class SlowAgent:
    """Answers each lookup once ``gate`` opens: nothing cached."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0

    def lookup_pages(self, *a, **k) -> Lookup:
        self.calls += 1
        self.gate.wait(5)
        return Lookup(0, 0, 0, None, b"")


def request(rid: str, tokens: int):
    return types.SimpleNamespace(
        request_id=rid,
        all_token_ids=list(range(tokens)),
        num_tokens=tokens,
        num_computed_tokens=0,
        mm_features=None,
        prompt_embeds=None,
        lora_request=None,
        cache_salt=None,
    )


def test_waiting_on_a_lookup_defers_only_requests_with_pages_to_look_up() -> None:
    agent = SlowAgent()
    s = SchedulerSide(Settings(lookup_timeout_s=1.0), BS, agent, Counts())
    try:
        cached = request("cached", 4 * BS + 1)  # vLLM's cache holds its 4 full blocks
        fresh = request("fresh", 4 * BS + 1)
        assert s.get_num_new_matched_tokens(cached, 4 * BS) == (0, False)
        assert s.get_num_new_matched_tokens(fresh, 0) == (None, False)
        for _ in range(20):
            # vLLM asks every step; the keys-only lookup of `cached` is still in flight.
            assert s.get_num_new_matched_tokens(cached, 4 * BS) == (0, False)
            assert s.get_num_new_matched_tokens(fresh, 0) == (None, False)
            time.sleep(0.005)
        agent.gate.set()
        deadline = time.monotonic() + 5
        while s.get_num_new_matched_tokens(fresh, 0)[0] is None:
            assert time.monotonic() < deadline, "the answer never came through"
            time.sleep(0.005)
        assert s.get_num_new_matched_tokens(fresh, 0) == (0, False)
    finally:
        agent.gate.set()
        s.shutdown()


def test_every_load_is_asynchronous_where_vllm_overlaps_steps() -> None:
    """Under async scheduling or pipeline parallelism vLLM runs the next step before a
    load's result is back, so a load before the forward pass that fails would leave a step
    computed over it: the scheduler announces every load as asynchronous, whatever
    ``load_async`` says."""
    for mode in ("auto", "never", "always"):
        side = SchedulerSide(
            Settings(load_async=mode), BS, SlowAgent(), Counts(), overlapped_steps=True
        )
        assert side.load_mode == "always", mode
        side.shutdown()
        assert SchedulerSide(Settings(load_async=mode), BS, SlowAgent(), Counts()).load_mode == mode


def test_every_load_is_asynchronous_where_the_agent_writes_into_vllms_blocks() -> None:
    """DMA (``dma``, or ``auto`` on a GPU): vLLM keeps an asynchronous load's blocks until it
    is reported finished, which a failed DMA load is only once the agent's copies into them
    stopped; a synchronous load has no such hold."""
    for transfer, device, dma in (
        ("dma", "cpu", True),
        ("auto", "cuda", True),
        ("auto", "cpu", False),
        ("staging", "cuda", False),
    ):
        settings = Settings(transfer=transfer)
        assert settings.may_dma(device) == dma, (transfer, device)
        for mode in ("auto", "never", "always"):
            side = SchedulerSide(
                Settings(load_async=mode, transfer=transfer), BS, SlowAgent(), Counts(), dma=dma
            )
            assert side.load_mode == ("always" if dma else mode), (transfer, device, mode)
            side.shutdown()


class BrokenAgent:
    """A lookup that raises something other than the agent's errors (a bug, a token id the
    wire cannot carry)."""

    def __init__(self) -> None:
        self.calls = 0

    def lookup_pages(self, *a, **k) -> Lookup:
        self.calls += 1
        raise ValueError("tokens: every token id must be an int in 0..2**32-1")


def test_a_lookup_that_raises_anything_is_a_miss_said_once(caplog) -> None:
    """Review finding (issue 61): only the agent's errors were caught, so any other error a
    lookup thread met was raised out of get_num_new_matched_tokens on vLLM's scheduler
    thread, taking the engine core down. Every failure is a miss, logged once."""
    agent = BrokenAgent()
    s = SchedulerSide(Settings(), BS, agent, Counts())
    try:
        r = request("r", 4 * BS + 1)
        deadline = time.monotonic() + 5
        while (answer := s.get_num_new_matched_tokens(r, 0))[0] is None:
            assert time.monotonic() < deadline, "the failed lookup never answered"
            time.sleep(0.005)
        assert answer == (0, False) and agent.calls == 1
        for _ in range(5):
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        said = [m for m in caplog.messages if "lookup failed" in m]
        assert len(said) == 1 and "ValueError" in said[0], said
    finally:
        s.shutdown()
