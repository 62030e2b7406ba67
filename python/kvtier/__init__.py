"""kvtier's Python package: clients of kvtierd and the agent, and engine integrations.

- :mod:`kvtier.host`: kvtierd's host tier (sessions, the mapped page pool and its page
  protocol, prefetch, stats, metrics watch) and the admin service;
- :mod:`kvtier.agent`: a kvtier-agent's engine API;
- :mod:`kvtier.keys`: page keys as docs/hash-spec.md specifies them;
- :mod:`kvtier.layout`: the page layout an integration declares (``LayoutSpec``);
- :mod:`kvtier.identity`: what keeps caches apart (model, weights, dtype, epoch), for both
  integrations; :mod:`kvtier.settings`: their settings from the engines' JSON config;
- :mod:`kvtier.integrations`: one subpackage per engine,

  - :mod:`kvtier.integrations.sglang`: SGLang's HiCache storage backend, loaded as
    ``kvtier.sglang`` (``--hicache-storage-backend dynamic``);
  - :mod:`kvtier.integrations.vllm`: vLLM's KV connector, loaded as ``kvtier.vllm``
    (``--kv-transfer-config`` with ``"kv_connector_module_path": "kvtier.vllm"``);

- :mod:`kvtier.testing`: real kvtierd and agent processes and fixtures, for the tests and
  benches of a checkout;
- :mod:`kvtier.v1`: the gRPC stubs, generated from proto/ (scripts/gen-python-stubs);
- ``kvtier._rpc``: the one channel and call helper, and ``KvtierError`` with its typed
  predicates (re-exported by :mod:`kvtier.host`).
"""

__version__ = "0.1.0"
