"""After an agent restart every DMA load and save thread of a vLLM worker meets the lost
registration at once. The worker registers vLLM's KV cache again once, and every call
retries under that registration: before, each thread registered again in turn, and each new
registration made the calls the others had just retried stale (a review finding)."""

from __future__ import annotations

import threading

import grpc

from kvtier.host import KvtierError
from kvtier.integrations.vllm.transfer import DmaTransfer


class RestartedAgent:
    """Knows one owner token, the newest registration's; nothing before the first."""

    def __init__(self) -> None:
        self.token = ""
        self.registrations = 0
        self.lock = threading.Lock()

    def register(self) -> str:
        with self.lock:
            self.registrations += 1
            self.token = f"owner-{self.registrations}"
            return self.token

    def call(self, owner: str) -> str:
        if not owner or owner != self.token:
            raise KvtierError(
                "Load: NOT_FOUND: no KV pool is registered", grpc.StatusCode.NOT_FOUND, "pool"
            )
        return owner


def transfer(agent: RestartedAgent) -> DmaTransfer:
    # Only what DmaTransfer._call reads: the registration lock and owner token.
    t = DmaTransfer.__new__(DmaTransfer)
    t._registering = threading.RLock()
    t._owner_token = "owner-before-the-restart"

    def register() -> None:
        t._owner_token = agent.register()

    t.register = register  # type: ignore[method-assign]
    return t


def test_threads_that_meet_a_lost_registration_at_once_register_once() -> None:
    agent = RestartedAgent()
    dma = transfer(agent)
    threads = 6
    # Every call is sent before any of them learns the registration is lost.
    sent = threading.Barrier(threads)
    answers: list[str] = []
    errors: list[BaseException] = []

    def one_call() -> None:
        first = [True]

        def fn() -> str:
            owner = dma._owner_token
            if first[0]:
                first[0] = False
                sent.wait(5)
            return agent.call(owner)

        try:
            answers.append(dma._call(None, fn))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=one_call) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not errors, errors
    assert agent.registrations == 1, f"registered {agent.registrations} times for one restart"
    assert answers == ["owner-1"] * threads
