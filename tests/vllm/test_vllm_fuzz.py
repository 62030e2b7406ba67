"""The engine fuzzer (fuzz.py) in the test suite: a fixed set of seeds, and the schedules that
found each wrong-KV defect kept as named regressions.

Every schedule runs vLLM workers (vLLM's own scheduler, connector factory, model runner hooks
and output aggregator) against real kvtierd and kvtier-agent processes, with a forward pass
that reads its context as attention does, and fails on any block that differs from the
oracle's recomputation and on a vacuous run (see fuzz.py). A failing seed replays with
``python tests/vllm/fuzz.py --seed N``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuzz import Schedule, Worker, fuzz_one, make_schedule, run_schedule
from vllm_harness import ENGINE, finish_worker, flag, run_worker, start_worker

# Seeds whose schedules cover, between them, TP 1 and 2, MHA and MLA, small and large L2
# pools, every kv_role and every fault kind (each run prints its schedule): 19 TP 2 MLA,
# 35 TP 2 MHA over a 128-page L2 (both with LoRA re-pointed), 48 TP 2 MHA with short loads
# and lost saves, 52 TP 1 MLA, 46 PP 2 with stage 1's saves lost and kvtierd stopped and
# killed. 19, 35, 48 and 52 run some workers under vLLM's AsyncScheduler (drawn since
# 2026-11-29). Slow L3 runs in the long fuzzer run.
SEEDS = [19, 35, 46, 48, 52]


@pytest.mark.parametrize("seed", SEEDS)
def test_fixed_seed_schedules_serve_no_wrong_block(seed, tmp_path):
    report = fuzz_one(seed, tmp_path)
    assert not report["problems"], (
        f"seed {seed} (replay: python tests/vllm/fuzz.py --seed {seed}): {report['problems']}"
    )


def _conversations(seed: int) -> tuple[list[dict], list[dict]]:
    """A first set of prompts and the same conversations continued."""
    s = make_schedule(seed)
    # The schedule's conversations, without the repeated-page prompt drawn for loads in
    # pieces (the named tests below were tuned on these).
    first = [p for p in s.workers[0].prompts if p["id"] != "w0-repeat"]
    again = [dict(p, id=p["id"] + "+", tokens=p["tokens"] + [7] * 40) for p in first]
    return first, again


def _after_a_first_worker(tmp_path, tp: int, first: Worker, w: Worker, again: list[dict]) -> dict:
    """Runs ``first``, then ``w`` over what it left, then a reader of ``again``; fails on any
    problem the schedule found."""
    report = run_schedule(Schedule(3, tp, False, 1024, [first, w, _check(again)]), tmp_path)
    assert not report["problems"], report["problems"]
    return report


def _check(again: list[dict]) -> Worker:
    return Worker("check", "kv_consumer", [dict(p, id="check-" + p["id"]) for p in again], extra={})


def test_pages_computed_over_a_short_load_are_never_saved_and_the_recompute_is(tmp_path):
    """Defect: a Load that came back short (pages gone from L2 between lookup and load) left
    stale bytes in the blocks past it; vLLM ran the step, then rolled the request back, but
    the connector saved the pages that step computed over the stale blocks, and moved past
    vLLM's recompute, which was never saved. A later worker loaded the wrong pages."""
    first, again = _conversations(3)
    short_loads = ["--short-loads", "0.6"]
    w = Worker("short", "kv_both", again, short_loads, {"load_async": "never"}, ["short_loads"])
    report = _after_a_first_worker(tmp_path, 1, Worker("w0", "kv_both", first), w, again)
    short = report["runs"][1]
    assert short["load_error_blocks"] > 0, "no load fell short"
    # vLLM's recompute of the failed pages was saved: the scheduler side rewound.
    assert short["scheduler"]["rewound_pages"] > 0, short["scheduler"]


def test_under_async_scheduling_no_step_runs_over_a_load_that_failed(tmp_path):
    """Defect (fuzz seeds 2, 3, 19 and 35, once workers drew vLLM's AsyncScheduler): it
    schedules and runs step N+1 before step N's output is back. A load before step N's
    forward pass that fell short rolled the request back, but step N+1 had already run over
    the failed blocks, and vLLM 0.33 keeps its output (the request's next token). The
    harness, running N+1 as the model runner does, found its next position had no token.
    Under async scheduling every load is now asynchronous: it fails before the request
    computes anything."""
    first, again = _conversations(3)
    opts = ["--short-loads", "0.6", "--async-scheduling"]
    w = Worker("short", "kv_both", again, opts, {"load_async": "never"}, ["short_loads"])
    report = _after_a_first_worker(tmp_path, 1, Worker("w0", "kv_both", first), w, again)
    short = report["runs"][1]
    assert short["load_error_blocks"] > 0, "no load fell short"
    assert short["vllm_stats"]["overlapped_steps"] > 0, "no step ran before the last's output"
    assert short["scheduler"]["async_loads"] > 0, short["scheduler"]


def test_under_pipeline_parallelism_no_step_runs_over_a_load_that_failed(tmp_path):
    """Review finding (issue 61): with PP 2 vLLM turns async scheduling off, but its engine
    core still keeps a batch per stage in flight, so the next prefill chunk of a request ran
    over a load that fell short before the rollback, and vLLM kept the token it sampled
    (the harness now keeps as many steps in flight as vLLM and counts a kept token sampled
    over wrong blocks as wrong). Under PP every load is now asynchronous too."""
    first, again = _conversations(3)
    chunks = ["--max-batched-tokens", "32"]
    w0 = Worker("w0", "kv_both", first, chunks)
    opts = ["--short-loads", "0.6", *chunks]
    w = Worker("short", "kv_both", again, opts, {"load_async": "never"}, ["short_loads"])
    report = run_schedule(Schedule(3, 1, False, 1024, [w0, w, _check(again)], pp=2), tmp_path)
    assert not report["problems"], report["problems"]
    short = report["runs"][1]
    assert short["load_error_blocks"] > 0, "no load fell short"
    assert short["vllm_stats"]["overlapped_steps"] > 0, "no step ran before the last's output"
    assert short["scheduler"]["async_loads"] > 0, short["scheduler"]


def test_dma_saves_never_read_a_preempted_requests_blocks_after_vllm_reuses_them(tmp_path):
    """Defect 3 (issue 61): with DMA (the agent reading vLLM's blocks in place; here its CPU
    stand-in, the KV cache in shared memory), a preempted request's saves still queued or on
    the wire after ``handle_preemptions`` stopped waiting for them (``timeout_s`` + 1 s) read
    blocks vLLM had given to another request, and stored them under the preempted
    request's keys. The save thread now skips saves of requests whose preemption gave up,
    and cancels the one the agent is copying (the agent's fence stops it). With both
    reverted this schedule finds 24 wrong blocks (12 when the reader read back only the
    continued conversations, not the first requests' decode pages). It does not guard the
    skip alone: here no save of the preempted request is queued behind the late one when
    the wait gives up (``save_preempted_pages`` is 0 with the fix)."""
    first, again = _conversations(3)
    for p in first:
        p["max_tokens"] = 40
    need = [-(-(len(p["tokens"]) + p["max_tokens"]) // 16) for p in first]
    blocks = max(max(need) + 2, int(sum(need) * 0.5))
    opts = ["--blocks", str(blocks), "--squeeze", "--late-save", "5.5"]
    w0 = Worker("w0", "kv_both", first, opts, {"transfer": "dma"}, ["preempt", "late_save"])
    # The reader reads back the first requests too, with what they generated: the late save
    # may be of a decode page, which no continued conversation reads.
    report = run_schedule(Schedule(3, 1, False, 1024, [w0, _check(first + again)]), tmp_path)
    assert not report["problems"], report["problems"]
    run = report["runs"][0]
    stats = run["workers"][0]
    assert stats["dma_fallbacks"] == 0 and stats["saved_pages"] > 0, stats
    # The late save was cancelled, or skipped: its pages given up, counted.
    assert stats["save_failed_pages"] + stats["save_preempted_pages"] > 0, stats
    assert report["runs"][1]["scheduler"]["external_tokens"] > 0, "the reader loaded nothing"


def test_a_dma_load_past_its_deadline_never_writes_blocks_vllm_gave_to_another_request(
    tmp_path,
):
    """Defect 8 (issue 61): a DMA Load that outlived its client's deadline (the agent waiting
    for kvtierd, here stopped through the deadline) went on copying into blocks the worker
    had reported failed, after vLLM, its client gone, had given them to another request.
    Each call's fence now closes at its deadline (and when its client leaves), so the late
    copy copies nothing: the agent counts it ``late``. With both reverted this schedule finds
    8 blocks written while another request held them."""
    first, again = _conversations(3)
    w0 = Worker("w0", "kv_both", first)
    w1 = Worker(
        "w1", "kv_consumer", again, [], {"transfer": "dma", "load_async": "never"}, ["stall"]
    )
    report = run_schedule(Schedule(3, 1, False, 1024, [w0, w1, _check(again)]), tmp_path)
    assert not report["problems"], report["problems"]
    run = report["runs"][1]
    assert run["faults"]["stall"] and run["faults"]["abort"], run["faults"]
    assert run["reused_blocks"] > 0 and run["load_error_blocks"] > 0, run


def test_a_load_in_pieces_loads_every_piece_under_its_own_parent(tmp_path):
    """A long prompt loaded through a small staging pool goes in pieces, each named by
    the key of the page before it, which the agent's answer for the piece before brings
    (``LoadPagesResponse.last_key``; the worker used to hash the pages itself). Every piece
    loads (a wrong key makes the rest miss), and its bytes are right: the prompt is one page
    repeated, so a parent one page off finds a page of the same prompt (33 wrong blocks
    when the worker took the key of the page before the last)."""
    rng = random.Random(7)
    page = [rng.randrange(1000) for _ in range(16)]
    first = [
        {"id": "repeat", "tokens": page * 40 + [5, 6, 7], "max_tokens": 2, "salt": None},
        {
            "id": "random",
            "tokens": [rng.randrange(1000) for _ in range(643)],
            "max_tokens": 2,
            "salt": None,
        },
    ]
    again = [dict(p, id=p["id"] + "+", tokens=p["tokens"] + [11, 12, 13]) for p in first]
    w0 = Worker("w0", "kv_both", first, [], {"load_async": "never"})
    w1 = Worker("w1", "kv_consumer", again, [], {"load_async": "never", "staging_pages": 16})
    report = _after_a_first_worker(tmp_path, 1, w0, w1, again)
    w1_run = report["runs"][1]
    loaded = sum(x["loaded_pages"] for x in w1_run["workers"])
    # Both prompts' 40 full pages, in pieces of 8 (half the pool).
    assert (loaded, w1_run["load_error_blocks"]) == (80, 0), w1_run["workers"]


def test_tp_ranks_whose_agents_hold_different_pages_save_nothing_computed_over_the_gap(
    tmp_path,
):
    """Defect: with TP 2, rank 1's agent lacked pages rank 0's lookup promised; rank 1's load
    fell short, and the all-reduce spread its garbage to rank 0, whose worker saved what it
    computed over it (it never saw rank 1's failure). Saves over a load now wait for every
    rank's result (StepsDone), and the pages rank 1 lacked are saved again after vLLM's
    recompute."""
    first, again = _conversations(3)
    lossy = Worker("w0", "kv_both", first, ["--drop-saves", "1:0.7"], faults=["drop_saves"])
    w = Worker("tp", "kv_both", again, [], {"load_async": "never"})
    report = _after_a_first_worker(tmp_path, 2, lossy, w, again)
    tp = report["runs"][1]
    assert tp["load_error_blocks"] > 0, "rank 1's agent held every page after all"
    assert tp["scheduler"]["rewound_pages"] > 0, tp["scheduler"]


def test_a_page_one_tp_rank_lacks_is_computed_not_looked_up_and_loaded_forever(tmp_path):
    """Found by the 30-minute run (seed 982391475): TP 2, rank 1's saves partly lost, then a
    worker loading asynchronously. Rank 0's lookup offered pages rank 1's agent lacks; each
    async load failed on rank 1, vLLM put the request back to waiting, and the connector
    offered the same pages again: 1.1 million page loads in 7 minutes, the engine never
    done. Now a request is never offered a page again at or past one its load failed at."""
    report = fuzz_one(982391475, tmp_path)
    assert not report["problems"], report["problems"]
    w1 = report["runs"][1]
    assert w1["load_error_blocks"] > 0 and w1["steps"] < 1000, w1["steps"]


def test_a_producer_never_loads(tmp_path):
    """Defect: kv_producer still looked up and loaded; vLLM fences block reuse against
    in-flight steps only for consumers."""
    first, again = _conversations(6)
    s = Schedule(
        6, 1, False, 1024, [Worker("w0", "kv_both", first), Worker("p", "kv_producer", again)]
    )
    report = run_schedule(s, tmp_path)
    assert not report["problems"], report["problems"]
    p = report["runs"][1]
    assert p["scheduler"]["external_tokens"] == 0 and p["scheduler"]["lookups"] == 0, p
    assert p["worker"]["saved_pages"] > 0, p["worker"]


def test_a_lora_name_re_pointed_at_other_weights_shares_no_page(tmp_path):
    """Defect: LoRA pages were keyed by the adapter's name alone. Re-pointing the name (here:
    the same name and the same path, a symlink swapped to other adapter files, as a
    deployment rolls out a retrained adapter) made later workers load KV computed under the
    old weights (the fuzzer's seeds 19, 53 and 65 found it: 65 to 194 wrong blocks per
    worker). The key now holds the adapter's content digest: the second worker recomputes,
    saves under the new adapter, and the reader loads only that."""
    first, again = _conversations(3)
    for p in first + again:
        p["lora"] = "a"
    s = Schedule(3, 1, False, 1024, [Worker("w0", "kv_both", first)], lora=[0, 1, 1])
    s.workers += [Worker("w1", "kv_both", again), _check(again)]
    report = run_schedule(s, tmp_path)
    assert not report["problems"], report["problems"]
    w1, check = report["runs"][1], report["runs"][2]
    # Nothing of w0's was offered to w1 (its adapter's weights differ); w1's own saves were
    # loaded by the reader, whose adapter is w1's.
    assert w1["scheduler"]["external_tokens"] == 0, w1["scheduler"]
    assert check["scheduler"]["external_tokens"] > 0, check["scheduler"]


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
def test_a_model_whose_blocks_vllm_frees_while_running_is_refused(tmp_path, kind):
    """Defect: a model whose every layer is sliding-window has one KV cache group, which the
    connector took; vLLM frees a running request's out-of-window blocks, and saves that read
    after the step copied their next owner's KV. Refused at start-up, naming the spec."""
    (tmp_path / "p.json").write_text("[]")
    out = subprocess.run(
        [
            sys.executable,
            str(ENGINE),
            "--kv-transfer-config",
            flag(str(tmp_path / "nobody.sock")),
            "--prompts",
            str(tmp_path / "p.json"),
            "--out",
            str(tmp_path / "out.json"),
            "--spec",
            kind,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert out.returncode != 0
    want = {"sliding_window": "SlidingWindowSpec", "chunked_local": "ChunkedLocalAttentionSpec"}
    assert want[kind] in out.stderr and "full attention only" in out.stderr, out.stderr[-2000:]
    assert not Path(tmp_path / "out.json").exists()


def test_a_hung_agent_delays_admissions_by_one_lookup_deadline_not_one_per_request(tmp_path, node):
    """Defect: lookups ran one at a time on one thread, so with the agent hung (SIGSTOP) the
    k-th waiting request was admitted after k x timeout_s. Lookups now have a deadline of
    their own, run several at once, and a lookup that times out pauses the rest: every
    request is answered "nothing cached" at once for lookup_pause_s."""
    _, agent = node
    first, _ = _conversations(6)
    a = agent("hung")
    kv = flag(a, timeout_s=1.0, lookup_timeout_s=0.5, lookup_pause_s=30)
    proc, out = start_worker(tmp_path, "hung", kv, first, stop=f"{a.proc.pid}@1")
    try:
        r = finish_worker(proc, out)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    admitted = r["vllm_stats"]["admitted_s"]
    assert len(admitted) == len(first) and r["wrong_blocks"] == 0, r
    # One lookup deadline for the first ones (a few at once), none for the rest; one
    # thread, one request at a time, took len(first) x 0.5 s.
    assert max(admitted.values()) < 2.0, sorted(admitted.values())
    sched = r["scheduler"]
    assert sched["lookup_failures"] >= 1 and sched["lookups_skipped"] > 0, sched


def test_a_killed_worker_leaves_no_staging_file(tmp_path, node):
    """Defect: a crashed vLLM worker left its staging pool's file in /dev/shm for good (a
    128 MiB orphan on a test machine). The staging pool is a memfd now, handed to the agent
    as a descriptor: it never has a name in any directory, and its memory goes with the last
    of the two processes."""
    _, agent = node
    first, _ = _conversations(6)
    a = agent("crash")
    kv = flag(a)
    shm_before = set(os.listdir("/dev/shm"))
    many = [dict(p, id=f"{p['id']}-{i}") for i in range(4) for p in first]
    proc, _ = start_worker(tmp_path, "crash", kv, many)
    try:
        # Registered and stepping: the agent maps the pool while saves go through it.
        deadline = time.monotonic() + 120
        while (
            a.metric(
                'kvtier_agent_backup_pages_total{outcome="stored",policy="write_through"}', 0.0
            )
            == 0
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "never saved a page"
            time.sleep(0.05)
        # The agent maps the worker's memfd; no new name in /dev/shm.
        maps = Path(f"/proc/{a.proc.pid}/maps").read_text()
        assert "/memfd:kvtier-vllm-staging" in maps, "the agent maps no staging memfd"
        assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if "kvtier" in n]
    finally:
        proc.kill()
        proc.wait(30)
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if "kvtier" in n]
    # The agent still serves: a new worker registers a new pool.
    r = run_worker(tmp_path, "after", kv, first)
    assert (
        r["wrong_blocks"] == 0
        and r["worker"]["saved_pages"] + r["scheduler"]["external_tokens"] > 0
    )
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if "kvtier" in n]
