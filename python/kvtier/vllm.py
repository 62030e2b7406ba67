"""The name vLLM loads (``"kv_connector_module_path": "kvtier.vllm"``): kept as an import shim
over :mod:`kvtier.integrations.vllm`, where the connector lives."""

from kvtier.integrations.vllm import *  # noqa: F403 - the subpackage's whole surface
from kvtier.integrations.vllm import __all__ as __all__
