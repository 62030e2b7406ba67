"""vLLM's KV connector over kvtier (docs/vllm.md).

- ``connector.py``: :class:`KvtierConnector`, the ``KVConnectorBase_V1`` vLLM loads, which
  hands each call to its role's side;
- ``scheduler.py``: :class:`SchedulerSide`, lookups and each step's loads and saves;
- ``worker.py``: :class:`WorkerSide`, vLLM's worker-side bookkeeping: loads before the
  forward pass, saves after it, finished requests held for their saves;
- ``transfer.py``: the :class:`Transfer` interface a worker moves blocks through, chosen once,
  and its DMA implementation; ``staged.py``: its staging implementations (CPU, GPU);
- ``reads.py``: :class:`BlockReads`, the one rule for when a save may still read a request's
  blocks (held, waited for, given up);
- ``staging.py``: :class:`Staging`, the shared memory a worker copies blocks through;
- ``common.py``: settings, ranks, the step's jobs (:class:`KvtierMetadata`), counters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use, so that a submodule that needs no vLLM (staging.py) imports without it.
_WHERE = {
    "Counts": "common",
    "Job": "common",
    "KvtierMetadata": "common",
    "Ranks": "common",
    "Settings": "common",
    "KvtierConnector": "connector",
    "SchedulerSide": "scheduler",
    "namespace_of": "scheduler",
    "Staging": "staging",
    "WorkerSide": "worker",
}

if TYPE_CHECKING:
    from kvtier.integrations.vllm.common import Counts, Job, KvtierMetadata, Ranks, Settings
    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.scheduler import SchedulerSide, namespace_of
    from kvtier.integrations.vllm.staging import Staging
    from kvtier.integrations.vllm.worker import WorkerSide

__all__ = [
    "Counts",
    "Job",
    "KvtierConnector",
    "KvtierMetadata",
    "Ranks",
    "SchedulerSide",
    "Settings",
    "Staging",
    "WorkerSide",
    "namespace_of",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
