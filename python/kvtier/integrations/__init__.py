"""kvtier's engine integrations, one subpackage per engine.

- :mod:`kvtier.integrations.sglang`: SGLang HiCache's storage backend, straight to kvtierd
  (the engine keeps its own host pool);
- :mod:`kvtier.integrations.vllm`: vLLM's KV connector, through the worker's kvtier-agent
  (the engine's KV is on a device the agent maps).

Engines name them by their short paths, ``kvtier.sglang`` and ``kvtier.vllm``, which stay
as import shims. docs/ARCHITECTURE.md ("An engine integration") says which shape a new
engine takes.
"""
