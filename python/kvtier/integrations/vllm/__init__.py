"""vLLM's KV connector over kvtier (docs/vllm.md).

- ``connector.py``: :class:`KvtierConnector`, the ``KVConnectorBase_V1`` vLLM loads, which
  hands each call to its role's side;
- ``scheduler.py``: :class:`SchedulerSide`, lookups and each step's loads and saves;
- ``worker.py``: :class:`WorkerSide`, the staging pool registered with the agent, loads
  before the forward pass and saves after it;
- ``staging.py``: :class:`Staging`, the shared memory a worker copies blocks through;
- ``common.py``: settings, ranks, the step's jobs (:class:`KvtierMetadata`), counters.
"""

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
