"""SGLang HiCache's storage backend over kvtierd (docs/sglang.md).

- ``backend.py``: :class:`KvtierStorage`, the ``HiCacheStorage`` SGLang loads, and its
  settings;
- :class:`PoolLink` (``kvtier/pool_link.py``, shared with vLLM's secondary tier): one kvtierd
  session per SGLang host pool and the page moves over it (through
  :meth:`kvtier.host.HostSession.store` and ``load``);
- ``pages.py``: how a page's bytes reach a slot, per SGLang pool kind.
"""

from kvtier.integrations.sglang.backend import KvtierStorage, Settings
from kvtier.pool_link import PoolLink, Reporter, UnsupportedPool

__all__ = ["KvtierStorage", "PoolLink", "Reporter", "Settings", "UnsupportedPool"]
