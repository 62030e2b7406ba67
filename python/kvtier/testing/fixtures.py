"""pytest fixtures over real processes; a test directory's ``conftest.py`` imports the ones
it uses (``from kvtier.testing.fixtures import node``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.testing.processes import Agent, Kvtierd

# Starts an agent beside the node's kvtierd: (name, *settings, socket=...) -> Agent.
StartAgent = Callable[..., Agent]


@pytest.fixture
def kvtierd(tmp_path: Path) -> Iterator[Kvtierd]:
    """A kvtierd on ``tmp_path/daemon``."""
    d = Kvtierd(tmp_path / "daemon")
    yield d
    d.stop()


@pytest.fixture
def agent(tmp_path: Path, kvtierd: Kvtierd) -> Iterator[Agent]:
    """A kvtier-agent beside ``kvtierd``."""
    a = Agent(tmp_path, "agent", kvtierd.socket)
    yield a
    a.stop()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Kvtierd, StartAgent]]:
    """A kvtierd, and a function that starts agents beside it (all stopped at the end)."""
    d = Kvtierd(tmp_path / "daemon", "l2.pool_pages=1024")
    agents: list[Agent] = []

    def start(name: str, *sets: str, socket: Path | None = None) -> Agent:
        a = Agent(tmp_path, name, d.socket, *sets, socket=socket)
        agents.append(a)
        return a

    yield d, start
    for a in agents:
        a.stop()
    d.stop()
