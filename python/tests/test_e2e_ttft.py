"""The CPU twin of ``benches/e2e_ttft.py`` (time to first token with kvtier): the same code
on the ``cpu-small`` preset, with a real kvtierd, two real kvtier-agents (``KVTIERD_BIN``,
``KVTIERAGENT_BIN``) and a writer process. The agent maps the reader's and the writer's KV
caches by shared-memory descriptor (the GPU run maps them by CUDA IPC handle).

Checked here: every page an L2 hit and an L3 hit (kvtierd restarted, its file L3 kept)
loads is bit for bit what the reader computes itself, and the first token's logits match
the recompute's; a page poisoned after the load fails that check; a page corrupted in L3 is
never loaded (the run reports the short load, and the tail computes what was not loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.e2e_model import PRESETS
from kvtier.testing.e2e_ttft import Bench, table
from kvtier.testing.processes import ROOT

PRESET = PRESETS["cpu-small"]
BLOCK = PRESET.block_size


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    b = Bench(PRESET, tmp_path_factory.mktemp("e2e"))
    try:
        b.warm_up()
        yield b
    finally:
        b.close()


def test_l2_and_l3_hits_load_what_the_reader_computes_bit_for_bit(bench: Bench) -> None:
    rows = [bench.prompt(n) for n in PRESET.prompts]
    print()
    print(table(PRESET, rows))
    for r in rows:
        assert r.ok, [p for _, v in r.verdicts for p in v.problems]
        assert {t for t, _ in r.verdicts} == {"L2", "L3"}
        assert len(r.verdicts) == 2 * PRESET.repeat + 1
        for tier, v in r.verdicts:
            assert v.loaded_pages == v.expected_pages == (r.prompt - 1) // BLOCK, tier
            assert not v.differing and v.matches_writer, tier
            assert v.logits_exact or v.logits_max_diff <= v.logits_tolerance, tier
            assert v.same_first_token, tier
        assert r.l3.lookup_l2 == 0 and r.l3.lookup_l3 == r.prompt // BLOCK
        assert r.l2.total_s > 0 and r.l3.total_s > 0 and r.recompute_s > 0


def test_a_page_poisoned_after_the_load_fails_the_check(bench: Bench) -> None:
    n = PRESET.prompts[0]
    _, reference = bench.recompute(n)
    bench.save(n)
    h = bench.hit(n, "L2")
    assert bench.verify(n, h, reference).ok
    bench.cache.corrupt(bench.free[3], layer=1)
    v = bench.verify(n, h, reference)
    assert not v.ok
    assert v.differing == [(1, 3)]
    assert not v.matches_writer
    assert "1 loaded pages (first: page 3) differ" in v.problems[0], v.problems
    assert "the transfer changed them" in v.problems[0], v.problems


def test_a_page_corrupted_in_l3_is_never_loaded(bench: Bench) -> None:
    """Half of a prompt's L3 objects corrupted: after a restart kvtier loads only the pages
    before the first bad one (a bad page fails its checksum and is a miss), the tail
    computes the rest, and the run reports the short load."""
    n = 512
    files = set(bench.node.daemon.l3_files())
    _, reference = bench.recompute(n)
    bench.save(n)
    new = sorted(set(bench.node.daemon.l3_files()) - files)
    assert len(new) == n // BLOCK
    for f in new[::2]:
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    bench.restart_daemon()
    h = bench.hit(n, "L3")
    want = (n - 1) // BLOCK
    assert h.pages < want
    v = bench.verify(n, h, reference)
    assert not v.ok
    assert f"L3: kvtier loaded {h.pages} of the prompt's {want} pages" in v.problems
    # What did load is the reader's own, and the first token is still right.
    assert not v.differing
    assert v.logits_exact or v.logits_max_diff <= v.logits_tolerance


def test_the_bench_script_runs_the_cpu_preset_and_refuses_check_without_a_goal(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    script = str(ROOT / "benches" / "e2e_ttft.py")
    run = subprocess.run(
        [sys.executable, script, "--preset", "cpu-small", "--prompts", "256", "--repeat", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "256 tokens: L2 x2: pages bit-identical" in run.stdout, run.stdout
    assert "L3 x1: pages bit-identical" in run.stdout, run.stdout
    assert "LMCache MP 0.29 s vs 3.98 s = 0.073x" in run.stdout
    refused = subprocess.run(
        [sys.executable, script, "--preset", "cpu-small", "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == 2, refused.stderr
    assert "has no goal row" in refused.stderr
