"""SGLang HiCache's storage backend over kvtierd (docs/sglang.md).

- ``backend.py``: :class:`KvtierStorage`, the ``HiCacheStorage`` SGLang loads, and its
  settings;
- ``link.py``: :class:`PoolLink`, one kvtierd session per SGLang host pool and the page moves
  over it (through :meth:`kvtier.host.HostSession.store` and ``load``);
- ``pages.py``: how a page's bytes reach a slot, per SGLang pool kind.
"""

from kvtier.integrations.sglang.backend import KvtierStorage, Settings
from kvtier.integrations.sglang.link import PoolLink, Reporter
from kvtier.integrations.sglang.pages import UnsupportedPool

__all__ = ["KvtierStorage", "PoolLink", "Reporter", "Settings", "UnsupportedPool"]
