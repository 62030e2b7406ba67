"""What kvtier's tests and benches share: real kvtierd and kvtier-agent processes
(:mod:`kvtier.testing.processes`), pytest fixtures over them
(:mod:`kvtier.testing.fixtures`), a client of SGLang's HiCache RPC protocol
(:mod:`kvtier.testing.hicache_rpc`), SGLang's host pools built the way SGLang builds them
(:mod:`kvtier.testing.sglang`, which needs SGLang), the engine fuzzers' command line
(:mod:`kvtier.testing.fuzzing`), and answers as older servers give them
(:mod:`kvtier.testing.old_servers`).

The processes run the binaries of the checkout the package is installed from (editable, as
``scripts/setup`` installs it); nothing here is needed to run kvtier.
"""

from kvtier.testing.processes import (
    ROOT,
    Agent,
    Kvtierd,
    debug_binary,
    l3_objects,
    metric,
    run_as,
)

__all__ = ["ROOT", "Agent", "Kvtierd", "debug_binary", "l3_objects", "metric", "run_as"]
