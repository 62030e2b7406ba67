"""kvtier.vllm.KvtierConnector in the deployments vLLM's users run, inside vLLM's own
scheduler and connector factory (vllm_engine.py), against real kvtierd and kvtier-agent
processes: DP ranks, pipeline stages, fp8 KV formats, a served alias over different
checkpoints, weight updates, TP with MLA and with selective writes, a sidecar agent under
another uid, a staging pool on a small tmpfs, staging copies that fail and agent calls that
outlive their deadline.

Each test checks that no block vLLM counts as computed differs from recomputing it, and,
where two workers must not share pages, that one takes no external tokens from the other.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from vllm_harness import (
    Agent,
    Kvtierd,
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


def _stored(a: Agent) -> float:
    series = 'kvtier_agent_backup_pages_total{{outcome="{}",policy="{}"}}'
    return sum(
        a.metric(series.format(outcome, policy), 0.0)
        for outcome in ("stored", "present")
        for policy in ("write_through", "write_through_selective")
    )


def test_mla_with_tp_2_is_stored_once_and_every_rank_loads_it(tmp_path, node):
    """The latent is the same on every TP rank: rank 0 saves it, rank 1 saves nothing, and
    both ranks of another engine load the one copy (before: one copy per rank, each under
    its own fingerprint)."""
    _, agent = node

    def engine(name: str) -> tuple[list[Agent], str]:
        agents = [agent(f"{name}{r}", socket=tmp_path / f"{name}-{r}.sock") for r in (0, 1)]
        return agents, flag(str(tmp_path / f"{name}-{{tp_rank}}.sock"))

    ps = prompts(81, prefixes=3, each=2)
    (a0, a1), kv = engine("mla1")
    r = run_worker(tmp_path, "mla1", kv, ps, "--mla", "--tp", "2")
    assert r["wrong_blocks"] == 0, r
    w0, w1 = r["workers"]
    assert w0["saved_pages"] > 0 and w1["saved_pages"] == 0, r["workers"]
    assert (_stored(a0), _stored(a1)) == (w0["saved_pages"], 0)
    (b0, b1), kv = engine("mla2")
    r = run_worker(tmp_path, "mla2", kv, same_prompts_again(ps, 82), "--mla", "--tp", "2")
    assert r["wrong_blocks"] == 0 and r["load_error_blocks"] == 0, r
    w0, w1 = r["workers"]
    assert r["scheduler"]["external_tokens"] > 0
    assert w0["loaded_pages"] == w1["loaded_pages"] > 0, r["workers"]


def test_tp_2_selective_writes_save_the_same_pages_on_every_rank(tmp_path, node):
    """write_through_selective counts lookups, which only rank 0's agent sees: the selection
    travels with each save, so rank 1 stores what rank 0 stores (before: nothing)."""
    _, agent = node
    sets = ("cache.write_policy=write_through_selective", "cache.write_threshold=2")
    a = [agent(f"sel{r}", *sets, socket=tmp_path / f"sel-{r}.sock") for r in (0, 1)]
    kv = flag(str(tmp_path / "sel-{tp_rank}.sock"))
    ps = prompts(91, prefixes=3, each=2)
    # The same conversations twice (two engine runs): the second reaches the threshold.
    for run in range(2):
        batch = [dict(p, id=f"{p['id']}-run{run}") for p in ps]
        r = run_worker(tmp_path, f"sel{run}", kv, batch, "--tp", "2")
        assert r["wrong_blocks"] == 0, r
        w0, w1 = r["workers"]
        assert w0["saved_pages"] == w1["saved_pages"], r["workers"]
    assert _stored(a[0]) == _stored(a[1]) > 0


@pytest.mark.parametrize("which", ["load", "save"])
def test_a_call_past_its_deadline_never_shares_staging_with_a_late_copy(tmp_path, node, which):
    """The agent's copy of a timed-out Load or Save may outlive the call. The worker gives
    that staging pool up and registers a new one rather than reuse slots the late copy may
    still write or read; what the late Save commits is what the engine computed."""
    _, agent = node
    ps = prompts(101, prefixes=3, each=2)
    again = same_prompts_again(ps, 102)
    if which == "load":
        run_worker(tmp_path, "t1", flag(agent("t1")), ps)
        r = run_worker(tmp_path, "t2", flag(agent("t2")), again, "--time-out", "load")
        assert r["load_error_blocks"] > 0 and r["worker"]["loaded_pages"] > 0, r
    else:
        r = run_worker(tmp_path, "t1", flag(agent("t1")), ps, "--time-out", "save")
        assert r["worker"]["save_failed_pages"] > 0, r
    assert r["wrong_blocks"] == 0, r
    # At least that call's pool (on a loaded host another call may outlive its deadline too).
    assert r["worker"]["retired_staging"] >= 1, r
    # Everything in the shared tiers is what recomputing gives: a third engine loads it all
    # and finds no wrong block.
    r3 = run_worker(tmp_path, "t3", flag(agent("t3")), same_prompts_again(again, 103))
    assert r3["wrong_blocks"] == 0 and r3["scheduler"]["external_tokens"] > 0, r3


def test_a_staging_pool_that_cannot_be_replaced_is_tried_again_not_given_up(tmp_path, node):
    """A Save past its deadline retires its staging pool; creating the next one fails (no
    room in the staging directory). Before: the worker kept the retired pool, which gives
    no pages, and dropped every later save for good (0 of 74 pages saved). Now a transfer
    after ``STAGING_RETRY_S`` tries again, and the saves after it reach L2."""
    _, agent = node
    ps = prompts(111, prefixes=4, each=4)
    kv = flag(agent("r1"))
    opts = ("--time-out", "save", "--fail-new-staging", "1", "--max-batched-tokens", "32")
    r = run_worker(tmp_path, "r1", kv, ps, *opts)
    assert r["wrong_blocks"] == 0, r
    assert r["worker"]["retired_staging"] == 1, r
    assert r["worker"]["save_dropped_pages"] > 0, r
    assert r["worker"]["saved_pages"] > 0, r


KVTIER_UID = 10001  # the image's kvtier user (deploy/container), which runs both sidecars
WORKER_UID = 20000  # the engine's own user, in kvtier's group as the k8s example sets it


@pytest.mark.skipif(os.geteuid() != 0, reason="starts processes under other uids (setpriv)")
def test_a_sidecar_agent_under_another_uid_registers_and_saves_the_workers_pages():
    """The k8s example's shape without Kubernetes: kvtierd and the agent run as uid 10001;
    the vLLM worker as uid 20000 in group 10001. The worker's staging pool is a memfd it
    hands the agent as a descriptor, so no directory, file mode or group is shared; the
    agent's sockets admit the group. (Before: a staging file the agent opened by path had to
    be 0660 in a shared setgid directory, and at 0600 the worker could not start.)"""
    base = Path(tempfile.mkdtemp(prefix="kvtier-sidecar-", dir="/tmp"))
    try:
        base.chmod(0o755)
        kvtier = (KVTIER_UID, KVTIER_UID, [])
        worker = (WORKER_UID, WORKER_UID, [KVTIER_UID])
        for name, mode, gid in (("daemon", 0o700, KVTIER_UID), ("agent", 0o750, KVTIER_UID)):
            (base / name).mkdir(mode=mode)
            os.chown(base / name, KVTIER_UID, gid)
        work = base / "work"
        work.mkdir()
        work.chmod(0o777)
        d = Kvtierd(base / "daemon", "l2.pool_pages=512", user=kvtier)
        agents = []
        try:
            for name in ("side1", "side2"):
                agents.append(
                    Agent(
                        base / "agent",
                        name,
                        d.socket,
                        "server.unix.mode=0660",
                        f"server.unix.allow_gids={KVTIER_UID}",
                        user=kvtier,
                    )
                )
            ps = prompts(111, prefixes=3, each=2)
            r1 = run_worker(work, "side1", flag(agents[0]), ps, user=worker)
            assert r1["wrong_blocks"] == 0 and r1["worker"]["saved_pages"] > 0, r1
            assert r1["worker"]["save_failed_pages"] == 0, r1
            r2 = run_worker(
                work, "side2", flag(agents[1]), same_prompts_again(ps, 112), user=worker
            )
            assert r2["wrong_blocks"] == 0 and r2["worker"]["loaded_pages"] > 0, r2
        finally:
            for a in agents:
                a.stop()
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
