"""kvtier.vllm.KvtierConnector in the deployments vLLM's users run, inside vLLM's own
scheduler and connector factory (vllm_engine.py), against real kvtierd and kvtier-agent
processes: DP ranks, pipeline stages, fp8 KV formats, a served alias over different
checkpoints, weight updates, a staging pool on a small tmpfs, and staging copies that fail.

Each test checks that no block vLLM counts as computed differs from recomputing it, and,
where two workers must not share pages, that one takes no external tokens from the other.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from vllm_harness import (
    finish_worker,
    flag,
    prompts,
    run_worker,
    same_prompts_again,
    start_worker,
)


def test_dp_ranks_reach_their_own_agents_under_the_default_socket_template(tmp_path, node):
    """Before: the template named agents by TP rank, so every DP rank's worker reached
    agent 0, and the agent served whichever registered last."""
    _, agent = node
    # One agent per GPU, at the connector's default (relative) path, as docs/vllm.md says.
    data = tmp_path / "kvtier-data"
    data.mkdir()
    a0 = agent("gpu0", socket=data / "kvtier-agent-0.sock")
    a1 = agent("gpu1", socket=data / "kvtier-agent-1.sock")
    ps = prompts(11)
    # Two DP ranks at once, each a worker on its own GPU with prompts of its own.
    ps0, ps1 = ps[::2], ps[1::2]
    w0 = start_worker(tmp_path, "dp0", flag(None), ps0, "--dp-rank", "0", cwd=tmp_path)
    w1 = start_worker(tmp_path, "dp1", flag(None), ps1, "--dp-rank", "1", cwd=tmp_path)
    r0, r1 = finish_worker(*w0), finish_worker(*w1)
    for r in (r0, r1):
        assert r["wrong_blocks"] == 0 and r["load_error_blocks"] == 0, r
        assert r["worker"]["saved_pages"] > 0 and r["worker"]["save_failed_pages"] == 0, r
    # Each agent saved its own worker's pages: the sum is every page both computed.
    series = 'kvtier_agent_backup_pages_total{{outcome="{}",policy="write_through"}}'
    saved = [
        a.metric(series.format("stored"), 0.0) + a.metric(series.format("present"), 0.0)
        for a in (a0, a1)
    ]
    assert saved == [r0["worker"]["saved_pages"], r1["worker"]["saved_pages"]]
    # DP ranks share through L2: rank 1 continues rank 0's conversations from kvtier.
    r = run_worker(
        tmp_path, "dp1b", flag(None), same_prompts_again(ps0, 12), "--dp-rank", "1", cwd=tmp_path
    )
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] > 0, r


def test_pipeline_stages_never_load_each_others_pages(tmp_path, node):
    _, agent = node
    ps = prompts(21, prefixes=3, each=2)
    r0 = run_worker(tmp_path, "pp0", flag(agent("pp0")), ps, "--pp-stage", "0")
    assert r0["wrong_blocks"] == 0 and r0["worker"]["saved_pages"] > 0
    again = same_prompts_again(ps, 22)
    # Stage 1 has the same block shape (an even split) but other layers.
    r1 = run_worker(tmp_path, "pp1", flag(agent("pp1")), again, "--pp-stage", "1")
    assert r1["wrong_blocks"] == 0
    assert r1["scheduler"]["external_tokens"] == 0, r1
    # Stage 0 of another replica does share them.
    r2 = run_worker(tmp_path, "pp0b", flag(agent("pp0b")), again, "--pp-stage", "0")
    assert r2["wrong_blocks"] == 0 and r2["scheduler"]["external_tokens"] > 0, r2


def test_fp8_formats_never_share_pages(tmp_path, node):
    """vLLM keeps every fp8 cache as bytes: only the format in the identity tells E4M3 pages
    from E5M2 ones."""
    _, agent = node
    ps = prompts(31, prefixes=3, each=2)
    again = same_prompts_again(ps, 32)
    r = run_worker(tmp_path, "e4m3", flag(agent("e4m3")), ps, "--kv-dtype", "fp8_e4m3")
    assert r["wrong_blocks"] == 0 and r["worker"]["saved_pages"] > 0
    r = run_worker(tmp_path, "e5m2", flag(agent("e5m2")), again, "--kv-dtype", "fp8_e5m2")
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] == 0, r
    r = run_worker(tmp_path, "e4m3b", flag(agent("e4m3b")), again, "--kv-dtype", "fp8_e4m3")
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] > 0, r


def test_a_served_alias_over_another_checkpoint_shares_nothing(tmp_path, node):
    _, agent = node
    ps = prompts(41, prefixes=3, each=2)
    again = same_prompts_again(ps, 42)
    alias = ("--served-name", "llm")
    r = run_worker(tmp_path, "m0", flag(agent("m0")), ps, *alias, "--variant", "0")
    assert r["wrong_blocks"] == 0 and r["worker"]["saved_pages"] > 0
    r = run_worker(tmp_path, "m1", flag(agent("m1")), again, *alias, "--variant", "1")
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] == 0, r
    # The same checkpoint under another alias is the same model.
    other = ("--served-name", "chat")
    r = run_worker(tmp_path, "m0b", flag(agent("m0b")), again, *other, "--variant", "0")
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] > 0, r


def test_a_weight_update_and_cache_reset_serve_none_of_the_old_kv(tmp_path, node):
    _, agent = node
    ps = prompts(51, prefixes=3, each=2)
    then = same_prompts_again(ps, 52)
    (tmp_path / "then.json").write_text(json.dumps(then))
    a = agent("rl")
    r = run_worker(tmp_path, "rl", flag(a), ps, "--reset-then", str(tmp_path / "then.json"))
    # vLLM's reset reported success only after the connector reset, and nothing computed
    # with the old weights was loaded (it would be a wrong block against the new ones).
    assert r["reset_ok"] is True
    assert r["wrong_blocks"] == 0, r
    assert r["scheduler"]["external_tokens"] == 0, r
    # After the update the pages are saved again, under the new epoch.
    assert r["worker"]["saved_pages"] > 0


def test_a_staging_pool_that_does_not_fit_is_a_clear_error_not_a_sigbus(tmp_path, node):
    _, agent = node
    small = tmp_path / "small-shm"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        # 2 layers x 1024 pages x 2 KiB blocks: 4 MiB, in 1 MiB.
        kv = flag(agent("small"), staging_dir=str(small), staging_pages=1024)
        proc, _ = start_worker(tmp_path, "small", kv, prompts(61, prefixes=1, each=1))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1, (proc.returncode, err[-2000:])
        assert "ValueError" in err and str(small) in err and "staging" in err, err[-2000:]
        assert list(small.iterdir()) == []  # nothing left behind
    finally:
        # Lazily: an agent that mapped a file there (a failed run) holds it until it stops.
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.mark.parametrize("which", ["load", "save"])
def test_a_staging_copy_that_raises_costs_recompute_not_the_worker(tmp_path, node, which):
    _, agent = node
    ps = prompts(71, prefixes=3, each=2)
    again = same_prompts_again(ps, 72)
    r = run_worker(tmp_path, "c1", flag(agent("c1")), ps)
    assert r["wrong_blocks"] == 0
    r = run_worker(tmp_path, "c2", flag(agent("c2")), again, "--fail-copy", which)
    assert r["wrong_blocks"] == 0, r
    if which == "load":
        assert r["load_error_blocks"] > 0 and r["worker"]["load_error_pages"] > 0, r
    else:
        assert r["worker"]["save_failed_pages"] > 0, r
    solo = run_worker(tmp_path, "c3", flag(agent("c3"), tenant="alone"), again)
    assert r["outputs"] == solo["outputs"]
