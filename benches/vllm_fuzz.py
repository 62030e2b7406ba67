"""The vLLM engine fuzzer as a long run: random schedules for as long as asked, reporting
schedules, workers' steps, blocks checked, pages loaded and saved, and each fault, in total
and per second (tests/vllm/fuzz.py has what a schedule is; scripts/test runs fixed seeds).

    python benches/vllm_fuzz.py --minutes 30 [--json FILE]

Needs the debug or release kvtierd and kvtier-agent (KVTIERD_BIN, KVTIERAGENT_BIN, or the
build in $CARGO_TARGET_DIR) and the test venv (scripts/setup). Exits 1 when any schedule
failed; each failing seed is printed with the command that replays it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    fuzz = Path(__file__).resolve().parents[1] / "tests" / "vllm" / "fuzz.py"
    sys.argv[0] = str(fuzz)
    runpy.run_path(str(fuzz), run_name="__main__")
