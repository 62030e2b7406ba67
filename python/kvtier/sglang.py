"""The name SGLang loads (``"module_path": "kvtier.sglang"``): kept as an import shim over
:mod:`kvtier.integrations.sglang`, where the backend lives."""

from kvtier.integrations.sglang import KvtierStorage, Settings
from kvtier.integrations.sglang.backend import *  # noqa: F403 - the shim's whole surface

__all__ = ["KvtierStorage", "Settings"]
