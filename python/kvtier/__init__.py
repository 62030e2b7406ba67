"""kvtier's Python package: clients of kvtierd and the agent, and engine integrations.

- :mod:`kvtier.host`: kvtierd's host tier (sessions, the mapped page pool, prefetch, stats,
  metrics watch) and the admin service;
- :mod:`kvtier.agent`: a kvtier-agent's engine API;
- :mod:`kvtier.keys`: page keys as docs/hash-spec.md specifies them;
- :mod:`kvtier.sglang`: SGLang's HiCache storage backend (``--hicache-storage-backend
  dynamic``);
- :mod:`kvtier.vllm`: vLLM's KV connector (``--kv-transfer-config`` with
  ``"kv_connector_module_path": "kvtier.vllm"``);
- :mod:`kvtier.identity`: what keeps caches apart (model, weights, dtype, epoch), for both;
- :mod:`kvtier.v1`: the gRPC stubs, generated from proto/ (scripts/gen-python-stubs);
- ``kvtier._rpc``: the one channel and call helper, and ``KvtierError`` with its typed
  predicates (re-exported by :mod:`kvtier.host`).
"""

__version__ = "0.1.0"
