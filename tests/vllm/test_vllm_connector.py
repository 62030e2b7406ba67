"""kvtier.vllm.KvtierConnector inside vLLM's own scheduler, against real kvtierd and
kvtier-agent processes, one vLLM worker process per agent (vllm_engine.py says what is
vLLM's and what is not).

The prompts share prefixes the way chat traffic does and all go in at once, so the scheduler
batches them, chunks their prefills and saves and loads concurrently. Every test checks that
no block vLLM counts as computed differs from recomputing it, and that a worker's outputs
are the same with the cache as without it.
"""

from __future__ import annotations

import time

import pytest
from vllm_harness import (
    Agent,
    Kvtierd,
    flag,
    prompts,
    run_worker,
    same_prompts_again,
)

from kvtier.testing import l3_objects


def test_a_second_worker_loads_the_prefixes_the_first_computed(tmp_path, node):
    d, agent = node
    a1, a2 = agent("w1"), agent("w2")
    ps = prompts(1)
    r1 = run_worker(tmp_path, "w1", flag(a1), ps)
    assert r1["wrong_blocks"] == 0
    assert r1["load_error_blocks"] == 0
    assert r1["scheduler"]["external_tokens"] == 0  # nothing cached yet
    # Worker 2, its own agent, never saw these: the same conversations one turn later.
    ps2 = same_prompts_again(ps, 2)
    r2 = run_worker(tmp_path, "w2", flag(a2), ps2)
    assert r2["wrong_blocks"] == 0
    assert r2["load_error_blocks"] == 0
    # At least the first conversation of each system prompt loads all of its earlier turn
    # from kvtier (its siblings may find some of it in worker 2's own prefix cache by then).
    ext = r2["scheduler"]["external_tokens"]
    firsts = [p for p in ps if p["id"].endswith("-0")]
    assert ext >= sum(16 * (len(p["tokens"]) // 16) for p in firsts), r2
    assert r2["worker"]["loaded_pages"] * 16 == ext
    # The scheduler never waited on the agent: each waiting request was first answered
    # "ask again" while its lookup ran on the background thread. Every job handed to the
    # workers carried its own pages' tokens only, named after its parent page's key.
    for r in (r1, r2):
        sched = r["scheduler"]
        assert sched["deferred_lookups"] >= len(ps), sched
        assert sched["lookups"] >= len(ps), sched
        assert sched["job_pages"] > 0 and sched["job_tokens"] == 16 * sched["job_pages"], sched
    assert a2.metric("kvtier_agent_load_back_pages_total") * 16 == ext
    assert a2.metric('kvtier_agent_load_failed_pages_total{reason="missing"}') == 0
    # vLLM's own stats carry it: its Prometheus metrics count what the workers loaded and
    # saved, its log line has the interval's figures, and every external hit is attributed
    # to a tier (L2 here: host), none left unspecified.
    for r in (r1, r2):
        prom, w = r["vllm_stats"]["prom"], r["worker"]
        assert prom.get("vllm:kvtier_loaded_pages_total", 0) == w["loaded_pages"], prom
        assert prom.get("vllm:kvtier_saved_pages_total", 0) == w["saved_pages"], prom
        assert prom.get("vllm:kvtier_saved_bytes_total", 0) == w["saved_bytes"] > 0, prom
        assert prom.get("vllm:kvtier_save_seconds_count", 0) > 0, prom
    assert r2["vllm_stats"]["logged"].get("loaded_pages") == r2["worker"]["loaded_pages"]
    assert r2["vllm_stats"]["hits_by_source"] == {"host": ext}, r2["vllm_stats"]
    # The outputs are what worker 2 computes without any cache.
    solo = run_worker(tmp_path, "solo", flag(agent("w3"), tenant="nobody-else"), ps2)
    assert solo["scheduler"]["external_tokens"] == 0
    assert r2["outputs"] == solo["outputs"]
    # Salted prompts (p3) never share pages with unsalted ones: a worker whose prompts are
    # the salted ones without the salt finds nothing of theirs.
    unsalted = [dict(p, id=p["id"] + "-nosalt", salt=None) for p in ps if p["salt"]]
    r3 = run_worker(tmp_path, "w4", flag(agent("w4")), unsalted)
    assert r3["scheduler"]["external_tokens"] == 0


def test_a_consumer_saves_nothing_and_decode_saves_can_be_left_out(tmp_path, node):
    """kv_role kv_consumer only loads; save_decode=false saves the prompt's pages only; and
    vLLM is told kvtier is a cache (a save a preemption drops is a later miss, not lost
    output), so it never recomputes a preempted request for it."""
    _, agent = node
    ps = prompts(11)
    stored = 'kvtier_agent_backup_pages_total{outcome="stored",policy="write_through"}'
    everything = run_worker(tmp_path, "all", flag(agent("all"), tenant="all"), ps)
    assert everything["requires_kv_delivery"] is False
    consumer = agent("consumer")
    r = run_worker(tmp_path, "consumer", flag(consumer, role="kv_consumer", tenant="c"), ps)
    assert r["wrong_blocks"] == 0
    assert r["worker"]["saved_pages"] == 0 and consumer.metric(stored, 0.0) == 0
    prompt_only = agent("prompt")
    r = run_worker(tmp_path, "prompt", flag(prompt_only, tenant="p", save_decode=False), ps)
    assert r["wrong_blocks"] == 0
    # The same requests: the prompt's pages are saved, the pages generated tokens filled
    # are not (every output here is long enough to fill one past the prompt somewhere).
    prompt_pages = sum(len(p["tokens"]) // 16 for p in ps)
    assert 0 < r["worker"]["saved_pages"] <= prompt_pages, r["worker"]
    assert r["worker"]["saved_pages"] < everything["worker"]["saved_pages"], (
        r["worker"],
        everything["worker"],
    )
    # A consumer finds what a producer saved, and loads it.
    again = same_prompts_again(ps, 12)
    r = run_worker(
        tmp_path, "consumer2", flag(agent("c2"), role="kv_consumer", tenant="all"), again
    )
    assert r["wrong_blocks"] == 0 and r["scheduler"]["external_tokens"] > 0, r["scheduler"]


def test_a_corrupt_l3_page_is_recomputed_never_loaded(tmp_path):
    l3 = tmp_path / "shared-l3"
    d1 = Kvtierd(tmp_path / "d1", "l2.pool_pages=512", f"l3.file.path={l3}")
    a1 = Agent(tmp_path, "c1", d1.socket)
    ps = prompts(3, prefixes=3, each=2)
    r1 = run_worker(tmp_path, "c1", flag(a1), ps)
    assert r1["wrong_blocks"] == 0
    # Let the writes to L3 land, then stop the node.
    deadline = time.time() + 30

    while len(l3_objects(l3)) < 10 and time.time() < deadline:
        time.sleep(0.1)
    a1.stop()
    d1.stop()
    files = l3_objects(l3)
    assert files, "nothing reached L3"
    for f in files[::2]:
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    # A fresh node (empty L2) over the same L3: every hit comes from L3.
    d2 = Kvtierd(tmp_path / "d2", "l2.pool_pages=512", f"l3.file.path={l3}")
    a2 = Agent(tmp_path, "c2", d2.socket)
    try:
        ps2 = same_prompts_again(ps, 4)
        r2 = run_worker(tmp_path, "c2", flag(a2), ps2)
        assert r2["wrong_blocks"] == 0
        assert r2["load_error_blocks"] > 0, r2
        assert a2.metric('kvtier_agent_load_failed_pages_total{reason="missing"}') > 0
        a3 = Agent(tmp_path, "c3", d2.socket)
        try:
            solo = run_worker(tmp_path, "c3", flag(a3, tenant="alone"), ps2)
        finally:
            a3.stop()
        assert r2["outputs"] == solo["outputs"]
    finally:
        a2.stop()
        d2.stop()


def test_pages_from_a_slow_l3_load_asynchronously_while_other_requests_step(tmp_path):
    """A node whose L3 answers each read after 2 s: requests whose pages come from L3 are
    told to vLLM as asynchronous loads and wait out of the batch; requests with nothing
    cached run to the end meanwhile. Nothing loaded differs from recomputing it."""
    l3 = tmp_path / "slow-l3"
    d1 = Kvtierd(tmp_path / "d1", "l2.pool_pages=512", f"l3.file.path={l3}")
    a1 = Agent(tmp_path, "s1", d1.socket)
    cached = prompts(5, prefixes=2, each=1)
    r1 = run_worker(tmp_path, "s1", flag(a1), cached)
    assert r1["wrong_blocks"] == 0
    deadline = time.time() + 30
    while len(l3_objects(l3)) < 10:
        assert time.time() < deadline, "nothing reached L3"
        time.sleep(0.1)
    time.sleep(1)
    a1.stop()
    d1.stop()
    # A fresh node over the same L3, each read delayed 2 s.
    d2 = Kvtierd(
        tmp_path / "d2", "l2.pool_pages=512", f"l3.file.path={l3}", "l3.fault_get_delay=2s"
    )
    a2 = Agent(tmp_path, "s2", d2.socket)
    try:
        slow = same_prompts_again(cached, 7)
        fresh = [dict(p, id=p["id"] + "-fresh") for p in prompts(6, prefixes=2, each=2)]
        fresh = [dict(p, tokens=[t + 1 for t in p["tokens"]]) for p in fresh]
        t0 = time.monotonic()
        r2 = run_worker(tmp_path, "s2", flag(a2), slow + fresh)
        took = time.monotonic() - t0
        assert r2["wrong_blocks"] == 0
        sched, tl = r2["scheduler"], r2["timeline"]
        assert sched["async_loads"] >= len(slow), sched
        assert r2["worker"]["loaded_pages"] > 0, r2["worker"]
        assert took >= 2, "the L3 delay never applied"
        # vLLM's prefix-cache stats attribute those hits to L3 (disk).
        assert r2["vllm_stats"]["hits_by_source"].get("disk", 0) > 0, r2["vllm_stats"]
        # Every fresh request ran to its end before any slow one was scheduled at all.
        last_fresh = max(tl[p["id"]][1] for p in fresh)
        first_slow = min(tl[p["id"]][0] for p in slow)
        assert last_fresh < first_slow, tl
        # And the outputs are what computing everything gives.
        a3 = Agent(tmp_path, "s3", d2.socket)
        try:
            solo = run_worker(tmp_path, "s3", flag(a3, tenant="alone"), slow + fresh)
        finally:
            a3.stop()
        assert r2["outputs"] == solo["outputs"]
    finally:
        a2.stop()
        d2.stop()


def test_async_loads_under_preemption_and_chunked_prefill(tmp_path, node):
    """Every load announced as asynchronous (load_async=always), with a KV pool so small
    that vLLM preempts requests, chunked prefills, and TP = 2 (a request's load is done when
    both ranks finished it): nothing loaded differs from recomputing it, and the outputs are
    those of a worker with nothing cached."""
    _, agent = node

    def engine(name: str, role: str = "kv_both", **extra) -> str:
        for r in (0, 1):
            agent(f"{name}{r}", socket=tmp_path / f"{name}-{r}.sock")
        return flag(str(tmp_path / f"{name}-{{tp_rank}}.sock"), role, **extra)

    ps = prompts(21, prefixes=3, each=3)
    r1 = run_worker(tmp_path, "p1", engine("p1"), ps, "--tp", "2")
    assert r1["wrong_blocks"] == 0
    # Long answers: running requests outgrow the small pool, so vLLM preempts some.
    again = [dict(p, max_tokens=64) for p in same_prompts_again(ps, 22)]
    small = ("--blocks", "30", "--tp", "2")
    r2 = run_worker(tmp_path, "p2", engine("p2", load_async="always"), again, *small)
    assert r2["wrong_blocks"] == 0, r2
    assert r2["scheduler"]["async_loads"] > 0, r2["scheduler"]
    assert r2["vllm_stats"]["preemptions"] > 0, "the pool was not small enough to preempt"
    assert all(w["loaded_pages"] > 0 for w in r2["workers"]), r2["workers"]
    # Nothing cached: a tenant of its own that saves nothing (its preempted requests would
    # otherwise find what they saved themselves).
    solo = run_worker(tmp_path, "p3", engine("p3", "kv_consumer", tenant="alone"), again, *small)
    assert solo["scheduler"]["external_tokens"] == 0
    assert r2["outputs"] == solo["outputs"]


def test_saves_copied_after_the_step_read_only_blocks_vllm_still_holds(tmp_path, node):
    """On CPU the save thread copies a step's new blocks after the step. With every save
    30 ms late (so are the copies queued behind it) and a KV pool so small that vLLM
    preempts requests and hands their blocks to others at once: vLLM keeps a finished
    request's blocks until the worker reports its saves done, and the step waits for a
    preempted request's copies, so every saved page is its request's own: a second worker
    loads them, and none differs from recomputing."""
    _, agent = node
    ps = [dict(p, max_tokens=48) for p in prompts(31, prefixes=3, each=3)]
    a1 = agent("h1")
    r1 = run_worker(tmp_path, "h1", flag(a1), ps, "--blocks", "30", "--slow-save", "0.03")
    assert r1["wrong_blocks"] == 0
    assert r1["vllm_stats"]["preemptions"] > 0, "the pool was not small enough to preempt"
    w = r1["worker"]
    assert w["saved_pages"] > 0, w
    assert w["save_dropped_pages"] == 0 and w["save_preempted_pages"] == 0, w
    # Every request had saves: vLLM held each one's blocks and freed them when told.
    assert r1["vllm_stats"]["held_released"] == len(ps), r1["vllm_stats"]
    a2 = agent("h2")
    r2 = run_worker(tmp_path, "h2", flag(a2), same_prompts_again(ps, 32))
    assert r2["wrong_blocks"] == 0
    assert r2["worker"]["loaded_pages"] > 0, r2["worker"]


def test_copies_too_late_for_a_preempted_request_are_given_up_and_counted(tmp_path, node):
    """Copies queued behind saves so slow that they start later than a preempted request
    can wait for (``timeout_s``): the step goes on and vLLM reuses the blocks, and the save
    thread gives those copies up, counted as ``save_preempted_pages``, rather than save
    what another request wrote there since. Nothing saved differs from recomputing."""
    _, agent = node
    ps = [dict(p, max_tokens=48) for p in prompts(33, prefixes=3, each=3)]
    a1 = agent("g1")
    late = flag(a1, timeout_s=0.3, staging_pages=8)
    r1 = run_worker(tmp_path, "g1", late, ps, "--blocks", "30", "--slow-save", "0.5")
    assert r1["wrong_blocks"] == 0
    assert r1["vllm_stats"]["preemptions"] > 0, "the pool was not small enough to preempt"
    assert r1["worker"]["save_preempted_pages"] > 0, r1["worker"]
    a2 = agent("g2")
    r2 = run_worker(tmp_path, "g2", flag(a2), same_prompts_again(ps, 34))
    assert r2["wrong_blocks"] == 0


def test_kvtierd_down_or_the_agent_killed_costs_recompute_only(tmp_path, node):
    d, agent = node
    a1 = agent("f1")
    ps = prompts(5, prefixes=3, each=2)
    r1 = run_worker(tmp_path, "f1", flag(a1), ps)
    assert r1["wrong_blocks"] == 0
    ps2 = same_prompts_again(ps, 6)
    # The agent killed while worker 2 runs (before its third step): every later call
    # fails, and the engine goes on computing.
    a2 = agent("f2")
    r2 = run_worker(tmp_path, "f2", flag(a2), ps2, kill=f"{a2.proc.pid}@3")
    assert r2["wrong_blocks"] == 0
    a3 = agent("f3")
    solo = run_worker(tmp_path, "f3", flag(a3, tenant="alone"), ps2)
    assert r2["outputs"] == solo["outputs"]
    # kvtierd down: the agent answers misses, loads load nothing, saves fail, counted.
    a4 = agent("f4")
    d.kill()
    r4 = run_worker(tmp_path, "f4", flag(a4), ps2)
    assert r4["wrong_blocks"] == 0
    assert r4["scheduler"]["external_tokens"] == 0
    assert r4["outputs"] == solo["outputs"]
    assert a4.metric('kvtier_agent_lost_pages_total{reason="daemon_unreachable"}') > 0


def test_settings_errors_name_the_key():
    from kvtier.vllm import Settings

    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        Settings.parse({"agnet": "x"})
    with pytest.raises(ValueError, match="load_policy"):
        Settings.parse({"load_policy": "eventually"})
    with pytest.raises(ValueError, match=r"extra_config.staging_pages: expected a int"):
        Settings.parse({"staging_pages": "many"})
    from kvtier.vllm import Ranks

    r = Ranks(tp=3, pp=1, dp=2, local=7)
    assert Settings.parse({"agent": "/run/a-{rank}.sock"}).agent_socket(r) == "/run/a-3.sock"
    tpl = "/run/a-{local_rank}-{dp_rank}-{pp_rank}-{tp_rank}.sock"
    assert Settings.parse({"agent": tpl}).agent_socket(r) == "/run/a-7-2-1-3.sock"
    assert Settings().agent_socket(r) == "kvtier-data/kvtier-agent-7.sock"
    with pytest.raises(ValueError, match=r"unknown placeholder \{gpu\}"):
        Settings.parse({"agent": "/run/a-{gpu}.sock"}).agent_socket(r)
    with pytest.raises(ValueError, match=r"extra_config.transfer: 'rdma' is not one of"):
        Settings.parse({"transfer": "rdma"})
    # Finished requests' blocks are held for saves only where they may be read after the
    # step: DMA from a GPU (the agent) and staging on CPU (the save thread's gather).
    assert Settings().holds_blocks("cuda")
    assert Settings().holds_blocks("cpu")
    assert Settings.parse({"transfer": "staging"}).holds_blocks("cpu")
    assert not Settings.parse({"transfer": "staging"}).holds_blocks("cuda")


def test_the_transfer_falls_back_to_staging_only_where_it_may_and_says_why():
    """``choose_transfer`` with registrations that succeed, are refused by the agent (no
    driver, a failed import check), cannot export (torch's allocator), or find the pool
    owned by another client."""
    import grpc

    from kvtier.host import KvtierError
    from kvtier.integrations.vllm.common import choose_transfer

    calls = []

    def ok() -> None:
        calls.append("ok")

    def refused() -> None:
        raise KvtierError("device unavailable: no libcuda", grpc.StatusCode.FAILED_PRECONDITION)

    def taken() -> None:
        raise KvtierError("owned by pid 7", grpc.StatusCode.ALREADY_EXISTS)

    def no_export() -> None:
        raise RuntimeError("expandable segments cannot be shared")

    assert choose_transfer("auto", "cuda:0", True, ok) == (True, None)
    assert choose_transfer("dma", "cuda:0", True, ok) == (True, None)
    assert choose_transfer("staging", "cuda:0", True, ok) == (False, None)
    assert choose_transfer("auto", "cpu", False, ok) == (False, None)
    assert calls == ["ok", "ok"]  # staging, and CPU workers, never try
    dma, why = choose_transfer("auto", "cuda:0", True, refused)
    assert not dma and why is not None and "no libcuda" in why
    dma, why = choose_transfer("auto", "cuda:0", True, no_export)
    assert not dma and why is not None and "expandable segments" in why
    with pytest.raises(KvtierError, match="no libcuda"):
        choose_transfer("dma", "cuda:0", True, refused)
    with pytest.raises(KvtierError, match="owned by pid 7"):
        choose_transfer("auto", "cuda:0", True, taken)
    with pytest.raises(ValueError, match="transfer: dma: cannot export"):
        choose_transfer("dma", "cuda:0", True, no_export)
    with pytest.raises(ValueError, match="transfer: dma needs the KV cache on a CUDA GPU .* cpu"):
        choose_transfer("dma", "cpu", False, ok)
    # On CPU, dma only over shared memory the agent maps (the fuzzer's stand-in); auto stays
    # staging there.
    assert choose_transfer("dma", "cpu", False, ok, in_shared_memory=True) == (True, None)
    assert choose_transfer("auto", "cpu", False, ok, in_shared_memory=True) == (False, None)
