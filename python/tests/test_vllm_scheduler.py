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


def test_every_load_is_asynchronous_under_vllms_async_scheduling() -> None:
    """Under async scheduling vLLM runs the next step before a load's result is back, so a
    load before the forward pass that fails would leave a step computed over it: the
    scheduler announces every load as asynchronous, whatever ``load_async`` says."""
    for mode in ("auto", "never", "always"):
        side = SchedulerSide(
            Settings(load_async=mode), BS, SlowAgent(), Counts(), async_scheduling=True
        )
        assert side.load_mode == "always", mode
        side.shutdown()
        assert SchedulerSide(Settings(load_async=mode), BS, SlowAgent(), Counts()).load_mode == mode
