"""Time to first token of a Llama-shaped model with kvtier, against recomputing the prompt
(``scripts/gpu-check --e2e`` runs it on a GPU; docs/GPU.md has what it measures and the
goal).

    python benches/e2e_ttft.py                        # gpu-8b: Llama-3.1-8B's shapes, bf16,
                                                      # prompts of 4k, 16k and 32k tokens
    python benches/e2e_ttft.py --check                # exit 1 when the 32k goal is missed
    python benches/e2e_ttft.py --preset cpu-small     # the CPU twin (tiny shapes)

It starts kvtierd and two kvtier-agents (``KVTIERD_BIN``, ``KVTIERAGENT_BIN``) and a writer
process; per prompt it times recompute, an L2 hit (the writer's pages loaded by the reader's
agent) and an L3 hit (kvtierd restarted, the pages loaded from its file L3), checks every
loaded page bit for bit against the reader's own recompute and the first token's logits
against the recompute's, and prints one table. A failed check exits 1. The code is
``kvtier.testing.e2e_ttft`` (the runner) and ``kvtier.testing.e2e_model`` (the model).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The checkout's package, when it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kvtier.testing.e2e_ttft import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
