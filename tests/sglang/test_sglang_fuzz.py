"""The SGLang HiCache fuzzer (sglang_fuzz.py) in the test suite: a fixed set of seeds.

Every schedule runs SGLang instances (each TP rank's kvtier backend from SGLang's own storage
factory over SGLang's own host pools) against a real kvtierd, with a forward pass that reads
its context from the host pages, and fails on any page that differs from the oracle's
recomputation and on a vacuous run. A failing seed replays with
``python tests/sglang/sglang_fuzz.py --seed N``.
"""

from __future__ import annotations

import pytest
from sglang_fuzz import fuzz_one, make_schedule

# Between them: MHA and MLA, TP 1 and 2, a 64-page L2 and slow L3, every fault (0: TP 2 MHA
# with a rank's backups lost, a weight update, clears and kvtierd stopped; 1: MLA; 5: kvtierd
# killed; 8: MLA on TP 2 with a weight update and a rank's backups lost).
SEEDS = [0, 1, 5, 8]


@pytest.mark.parametrize("seed", SEEDS)
def test_fixed_seed_schedules_serve_no_wrong_page(seed, tmp_path):
    report = fuzz_one(seed, tmp_path)
    assert not report["problems"], (
        f"seed {seed} (replay: python tests/sglang/sglang_fuzz.py --seed {seed}): "
        f"{report['problems']}"
    )
    assert sum(r["loaded"] for r in report["runs"]) > 0


def test_a_weight_update_leaves_no_page_of_the_old_weights_to_find(tmp_path):
    """What the fuzzer checks of clear(): with it made a no-op (the instance's keys stay in
    the old epoch), seed 2 served 12 wrong pages: pages of the old weights loaded after the
    weight update, and every page computed over them."""
    s = make_schedule(2)
    assert any("weight_update" in i.faults for i in s.instances), s.describe()
    report = fuzz_one(2, tmp_path)
    assert not report["problems"], report["problems"]
