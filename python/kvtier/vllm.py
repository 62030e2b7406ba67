"""The name vLLM loads (``"kv_connector_module_path": "kvtier.vllm"``): kept as an import shim
over :mod:`kvtier.integrations.vllm`, where the connector lives."""

from kvtier.integrations.vllm import (
    Counts,
    Job,
    KvtierConnector,
    KvtierMetadata,
    Ranks,
    Settings,
    namespace_of,
)

__all__ = ["Counts", "Job", "KvtierConnector", "KvtierMetadata", "Ranks", "Settings", "namespace_of"]
