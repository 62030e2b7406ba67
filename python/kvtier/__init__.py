"""kvtier's Python package: clients of kvtierd and the agent, and engine integrations.

- :mod:`kvtier.host`: kvtierd's host tier (sessions, the mapped page pool, prefetch, stats,
  metrics watch) and the admin service;
- :mod:`kvtier.agent`: a kvtier-agent's engine API;
- :mod:`kvtier.keys`: page keys as docs/hash-spec.md specifies them;
- :mod:`kvtier.sglang`: SGLang's HiCache storage backend (``--hicache-storage-backend
  dynamic``);
- :mod:`kvtier.v1`: the gRPC stubs, generated from proto/ (scripts/gen-python-stubs).
"""

__version__ = "0.1.0"
