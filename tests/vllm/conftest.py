"""The vLLM tests' fixtures (the helpers are in vllm_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import Agent, Kvtierd


@pytest.fixture
def node(tmp_path: Path):
    """A kvtierd, and a function that starts agents beside it (stopped at the end)."""
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=1024")
    agents: list[Agent] = []

    def agent(name: str, *sets: str, socket: Path | None = None) -> Agent:
        a = Agent(tmp_path, name, d.socket, *sets, socket=socket)
        agents.append(a)
        return a

    yield d, agent
    for a in agents:
        a.stop()
    d.stop()
