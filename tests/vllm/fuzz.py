"""The vLLM engine fuzzer: seeded random schedules of vLLM workers against real kvtierd and
kvtier-agent processes, every block checked against an oracle that recomputes everything.

Each worker is ``vllm_engine.py``: vLLM 0.33's own Scheduler, connector factory, model
runner hooks (``KVConnectorModelRunnerMixin``) and output aggregator, with kvtier's connector
loaded from the ``--kv-transfer-config`` flag. Its stand-in forward pass reads its context as
attention does (``vllm_engine.Model``: a position's KV is a function of the KV bytes of every
earlier position as they are in the blocks at that moment, on every TP rank), so a block
computed over a stale or foreign block comes out wrong, and so does everything after it.
After every step, every block the step read is compared with the oracle's (and a token vLLM
keeps from a step that read a wrong block counts as wrong); pages read back
from L2 and L3 are checked the same way when a later worker loads them, and the last worker
of every schedule (a consumer, no faults) reads back every request of the schedule: its
prompt and the tokens it generated, so decode pages too. Half the schedules then read it all
back again from L3 alone (kvtierd restarted, its L2 empty).

A schedule (:func:`make_schedule`, a pure function of its seed) draws:
- the deployment: TP 1 or 2, PP 1 or 2, MHA or MLA, the L2 pool's size (small: pages go
  through L3 and loads become asynchronous), the staging pool's size;
- 3 to 5 workers run one after another, continuing earlier conversations and starting new
  ones, each with its ``kv_role`` (kv_both, kv_producer, kv_consumer), ``load_async``,
  chunked prefill (a small token budget), a KV pool small enough that vLLM preempts;
- faults: short loads (a Load asks the agent for only some of its pages: the blocks past
  them keep their last owner's bytes), one TP rank's saves lost (the ranks' agents then hold
  different pages), a staging copy that raises, an agent call past its deadline while the
  agent still copies, saves behind a slow L2, an agent killed mid-run (restarted after),
  kvtierd stopped (SIGSTOP, resumed 0.5-3 s later) or killed (restarted on its directory)
  mid-run; reads and writes of L3 slowed (some reads longer than a load's deadline);
- LoRA: the conversations of some system prompts run under adapter ``a``, whose path is a
  symlink the schedule re-points between workers at another adapter's files (same name,
  same path, other weights: the stand-in's KV depends on the adapter's bytes);
- vLLM's AsyncScheduler (its default where the model runner allows it) for about half the
  workers: each step is scheduled and run before the previous one's output is taken, as
  vLLM's engine core runs its batch queue (under PP it keeps a step per stage in flight);
- the DMA transfer for about a third of the workers, over its CPU stand-in (the KV cache in
  shared memory, the agent reading and writing vLLM's blocks in place), where a preempted
  worker may draw ``late_save`` (the saves reading the preempted request's blocks go out
  past the connector's wait for them);
- aborts (requests the client leaves, waiting, loading or running), and ``stall``: kvtierd
  stopped through a Load's deadline while the agent waits for it, the request then aborted.

Wherever vLLM frees a running request's blocks, another request takes them at once, writes
its own KV and checks it is still there when it gives them back (vllm_engine's ``Reuse``):
a save that reads, or a load that writes, a block after vLLM gave it away is caught.

A schedule fails on any wrong block, on a block written while another request held it, and
on a vacuous run: the last worker loads pages
(when any were saved), every worker that saves saves some (unless its agent or kvtierd was
stopped or killed), and
each fault drawn for a worker happens in it (the first call a fault can meet always meets it;
a fault on loads in a worker that loaded nothing, because earlier faults left nothing to
find, is not asked of it). A failing seed is printed and replays the same schedule::

    python tests/vllm/fuzz.py --seed 17             # one schedule
    python tests/vllm/fuzz.py --minutes 30           # random seeds for 30 minutes; a report

The second form is the long run (``python benches/vllm_fuzz.py --minutes M``): schedules,
workers, events and blocks checked per second.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from vllm_harness import (  # noqa: E402 - the harness beside this file
    Agent,
    Kvtierd,
    finish_worker,
    flag,
    start_worker,
)

from kvtier.testing import fuzzing  # noqa: E402

# A worker's counts of pages it saved or gave up.
SAVE_OUTCOMES = ("saved_pages", "save_failed_pages", "save_dropped_pages", "save_preempted_pages")
# Faults a worker may be drawn, each with the figure that shows it happened.
FAULTS = ("short_loads", "drop_saves", "preempt", "fail_copy", "time_out", "slow_save", "kill")


@dataclass
class Worker:
    """One vLLM worker process of a schedule."""

    name: str
    role: str
    prompts: list[dict]
    opts: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    # Kill this agent (by TP rank) before this step of the run.
    kill: tuple[int, int] | None = None
    # Stop ("stop", SIGSTOP) or kill ("kill", SIGKILL) kvtierd before this step, for this
    # many seconds (then SIGCONT, or a restart on the same directory).
    daemon: tuple[str, int, float] | None = None


@dataclass
class Schedule:
    seed: int
    tp: int
    mla: bool
    l2_pages: int
    workers: list[Worker]
    # kvtierd's L3 read and write delays (``l3.fault_get_delay``, ``l3.fault_set_delay``).
    l3_delay: tuple[str, str] | None = None
    # Per worker, the adapter files LoRA ``a`` points to while it runs (None: no LoRA).
    lora: list[int] | None = None
    # Pipeline stages, TP ranks each (every worker of every stage has its own agent).
    pp: int = 1
    # The reader runs twice: then again on a restarted kvtierd whose L2 starts empty, so
    # that every page it loads comes from L3.
    readback_from_l3: bool = False

    def describe(self) -> str:
        parts = [f"seed {self.seed}: tp {self.tp}, pp {self.pp}, {'mla' if self.mla else 'mha'}"]
        parts.append(f"L2 {self.l2_pages} pages, L3 delays {self.l3_delay}, LoRA {self.lora}")
        if self.readback_from_l3:
            parts.append("read back again from L3 alone")
        for w in self.workers:
            parts.append(f"{w.name} {w.role} {' '.join(w.opts)} {w.extra} faults={w.faults}")
        return "\n  ".join(parts)


def _conversation(rng: random.Random, system: list[int], cid: str, salt: str | None) -> dict:
    turn = [rng.randrange(1000) for _ in range(rng.randrange(10, 50))]
    return {
        "id": cid,
        "tokens": system + turn,
        "max_tokens": rng.randrange(2, 20),
        "salt": salt,
    }


def make_schedule(seed: int) -> Schedule:
    """The schedule of ``seed``: the same every time."""
    rng = random.Random(seed)
    tp = rng.choice([1, 1, 2])
    mla = rng.random() < 0.3
    # Small pools send pages through L3 (loads from it are asynchronous); a quarter of the
    # schedules get an L2 of 48 pages below (issue 61 once saw eight concurrent loads there
    # hold every slot until their deadlines; not seen again since pins and leased slots are
    # released per call).
    l2_pages = rng.choice([128, 256, 1024])
    systems = [
        [rng.randrange(1000) for _ in range(16 * rng.randrange(3, 9))]
        for _ in range(rng.randrange(2, 5))
    ]
    salts = [None, None, "team-b"]
    live: list[dict] = []
    workers: list[Worker] = []
    n = rng.randrange(3, 6)
    for i in range(n):
        # New conversations, and earlier ones continued (their prefixes are in L2 or L3).
        ps = []
        for j in range(rng.randrange(3, 7)):
            s = rng.randrange(len(systems))
            ps.append(_conversation(rng, systems[s], f"w{i}-c{j}", rng.choice(salts)))
        for p in rng.sample(live, min(len(live), rng.randrange(2, 6))):
            more = [rng.randrange(1000) for _ in range(rng.randrange(8, 40))]
            ps.append(dict(p, id=f"w{i}-{p['id']}+", tokens=p["tokens"] + more))
        rng.shuffle(ps)
        live += ps
        role = (
            "kv_both"
            if i == 0
            else rng.choice(["kv_both", "kv_both", "kv_producer", "kv_consumer"])
        )
        w = Worker(f"w{i}", role, ps)
        w.extra["load_async"] = rng.choice(["auto", "auto", "always", "never"])
        w.extra["staging_pages"] = rng.choice([16, 64, 256])
        if rng.random() < 0.4:
            w.opts += ["--max-batched-tokens", str(rng.choice([32, 64]))]
        # Faults: at most three per worker.
        for f in rng.sample(FAULTS, rng.randrange(0, 4)):
            # MLA: only rank 0 saves, for both ranks; its agent's pages are the ranks' pages.
            if f == "drop_saves" and (tp < 2 or mla or role == "kv_consumer"):
                continue
            if f in ("short_loads",) and (i == 0 or role == "kv_producer"):
                continue
            if f == "fail_copy" and (i == 0 or role == "kv_producer"):
                continue
            w.faults.append(f)
        for f in w.faults:
            if f == "short_loads":
                w.opts += ["--short-loads", str(rng.choice([0.3, 0.6]))]
                # Mostly loads before the forward pass: the step computes over them.
                w.extra["load_async"] = rng.choice(["never", "never", "auto"])
            elif f == "drop_saves":
                w.opts += ["--drop-saves", f"{tp - 1}:{rng.choice([0.3, 0.6])}"]
            elif f == "preempt":
                for p in w.prompts:
                    p["max_tokens"] = rng.randrange(20, 60)
                # Room for the largest request, and for about half of all of them at once.
                need = [-(-(len(p["tokens"]) + p["max_tokens"]) // 16) for p in w.prompts]
                blocks = max(max(need) + 2, int(sum(need) * rng.choice([0.4, 0.5, 0.6])))
                # The pool alone preempts or not as loads happen to interleave; squeezing
                # it makes sure vLLM preempts at least once.
                w.opts += ["--blocks", str(blocks), "--squeeze"]
            elif f == "fail_copy":
                w.opts += ["--fail-copy", "load"]
            elif f == "time_out":
                w.opts += ["--time-out", "save" if role != "kv_consumer" else "load"]
            elif f == "slow_save":
                w.opts += ["--slow-save", str(rng.choice([0.02, 0.1]))]
            elif f == "kill":
                w.kill = (rng.randrange(tp), rng.randrange(2, 6))
        workers.append(w)
    # kvtierd stopped or killed under a worker, drawn from a generator of their own so that
    # the draws above (and the fixed seeds' schedules) stay as they were.
    drng = random.Random(f"daemon-{seed}")
    for w in workers[1:]:
        if drng.random() < 0.3 and w.kill is None:
            kind = drng.choice(["stop", "kill"])
            w.daemon = (kind, drng.randrange(2, 6), drng.choice([0.5, 1.5, 3.0]))
            w.faults.append(f"daemon_{kind}")
    # The last worker reads back every request of the schedule (its prompt and the tokens
    # it generated: ``run_schedule`` adds those), no faults, loads only.
    check = [dict(p, id=f"check-{p['id']}", max_tokens=2) for p in live]
    workers.append(Worker("check", "kv_consumer", check, extra={"load_async": "auto"}))
    s = Schedule(seed, tp, mla, l2_pages, workers)
    # Later draws come from generators of their own, so the draws above stay as they were.
    l3rng = random.Random(f"l3-{seed}")
    if l3rng.random() < 0.3:
        # Reads up to past a load's deadline (4 s; 2 s under a time_out fault).
        s.l3_delay = (l3rng.choice(["50ms", "300ms", "2500ms"]), l3rng.choice(["0ms", "100ms"]))
    _draw_lora(s, random.Random(f"lora-{seed}"))
    s.readback_from_l3 = random.Random(f"readback-{seed}").random() < 0.5
    if random.Random(f"l2-{seed}").random() < 0.25:
        s.l2_pages = 48
    _draw_repeats(s, random.Random(f"repeat-{seed}"))
    # PP 2 (TP 1 only, to keep a schedule's processes within two cores): the scheduler looks
    # up stage 0's agent; stage 1's worker loads from its own, which may lack pages.
    prng = random.Random(f"pp-{seed}")
    if tp == 1 and prng.random() < 0.3:
        s.pp = 2
        for w in s.workers[:-1]:
            if w.kill is not None:
                # Either stage's agent.
                w.kill = (prng.randrange(2), w.kill[1])
            if w.role != "kv_consumer" and "drop_saves" not in w.faults and prng.random() < 0.4:
                # Stage 1's saves partly lost: the stages' agents then hold different pages.
                w.opts += ["--drop-saves", f"1:{prng.choice([0.3, 0.6])}"]
                w.faults.append("drop_saves")
    # vLLM's AsyncScheduler (its default where the model runner allows it; not with PP on
    # the V1 runner): a step is scheduled and run before the last one's output is taken, so
    # the connector's scheduler side hears of a load's result one step late.
    arng = random.Random(f"async-{seed}")
    if s.pp == 1:
        for w in s.workers:
            if arng.random() < 0.5:
                w.opts.append("--async-scheduling")
    _draw_dma(s, random.Random(f"dma-{seed}"))
    # Aborts: vLLM's engine core finishing requests whose client left, whatever they are
    # doing (waiting, loading, running).
    brng = random.Random(f"abort-{seed}")
    for w in s.workers[:-1]:
        if brng.random() < 0.3:
            w.opts += ["--aborts", str(brng.choice([0.2, 0.4]))]
            w.faults.append("abort")
    # kvtierd stopped (SIGSTOP) through a worker's second Load's deadline while the agent
    # waits for its pages; the request is then aborted and its blocks another's before
    # kvtierd answers the agent.
    srng = random.Random(f"stall-{seed}")
    for w in s.workers[1:-1]:
        if w.role != "kv_producer" and w.daemon is None and srng.random() < 0.3:
            w.faults.append("stall")
    return s


def _draw_repeats(s: Schedule, rng: random.Random) -> None:
    """A prompt of one page repeated, for the first worker and the reader, which loads
    through a small staging pool (in pieces) in about half the schedules. Its pages' keys
    differ only by their parents, so a piece loaded after a parent one page off (the key
    the agent names for the rest of a load) finds a page of the same prompt, and its
    bytes are wrong: with random tokens such a piece would only miss."""
    page = [rng.randrange(1000) for _ in range(16)]
    turn = [rng.randrange(1000) for _ in range(rng.randrange(3, 15))]
    pages = rng.randrange(8, 20)
    w0 = s.workers[0]
    if "--blocks" in w0.opts:
        # Within the KV pool drawn for the worker's other requests, as their largest is
        # (its pages, a partial one for the turn and the decode tokens, 2 blocks to
        # spare), or vLLM could never schedule it (seed 52 hung with a pool of 14).
        blocks = int(w0.opts[w0.opts.index("--blocks") + 1])
        pages = max(2, min(pages, blocks - 4))
    p = {"id": "w0-repeat", "tokens": page * pages + turn, "max_tokens": 4}
    # First: a worker's first request is never aborted.
    w0.prompts.insert(0, dict(p, salt=None))
    s.workers[-1].prompts.append(dict(p, id="check-w0-repeat", max_tokens=2, salt=None))
    if rng.random() < 0.5:
        s.workers[-1].extra["staging_pages"] = 16


def _draw_dma(s: Schedule, rng: random.Random) -> None:
    """The worker's DMA path for about a third of the workers: their KV cache lies in shared
    memory and the agent reads and writes vLLM's blocks in place (the CPU stand-in for a
    GPU's DMA, the same worker code). Staging's own faults (a staging copy that raises, a
    call reported past its deadline while the agent may still copy into the staging pool)
    do not apply; a preempted worker may draw ``late_save``: the saves reading the preempted
    request's blocks outlive the connector's wait for them."""
    for w in s.workers:
        if rng.random() >= 0.35:
            continue
        w.extra["transfer"] = "dma"
        for f, flag_ in (("time_out", "--time-out"), ("fail_copy", "--fail-copy")):
            if f in w.faults:
                w.faults.remove(f)
                at = w.opts.index(flag_)
                del w.opts[at : at + 2]
        if "preempt" in w.faults and w.role != "kv_consumer" and rng.random() < 0.6:
            # Past handle_preemptions' wait (timeout_s + 1 s).
            w.opts += ["--late-save", "5.5"]
            w.faults.append("late_save")


def _draw_lora(s: Schedule, rng: random.Random) -> None:
    """Runs the conversations of some system prompts (those whose first 16 tokens draw it)
    under LoRA adapter ``a``, re-pointed at other weights between some workers."""
    if rng.random() >= 0.35:
        return
    s.lora = [rng.randrange(2) for _ in s.workers]
    # The reader runs the first worker's adapter (which always saves); some worker between
    # them another.
    s.lora[-1] = s.lora[0]
    if len(set(s.lora)) == 1:
        s.lora[rng.randrange(1, len(s.lora) - 1)] ^= 1
    under: dict[tuple[int, ...], bool] = {}
    for w in s.workers:
        for p in w.prompts:
            head = tuple(p["tokens"][:16])
            if head not in under:
                under[head] = rng.random() < 0.6
            if under[head]:
                p["lora"] = "a"


def _adapters(tmp: Path) -> tuple[list[Path], Path]:
    """Two versions of a LoRA adapter's files, and the path adapter ``a`` is served from:
    a symlink to one of them."""
    versions = []
    for v in range(2):
        d = tmp / "lora" / f"v{v}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
        (d / "adapter_model.safetensors").write_bytes(f"adapter weights, version {v}".encode())
        versions.append(d)
    return versions, tmp / "lora" / "current"


def _point(link: Path, at: Path) -> None:
    """Re-points ``link`` at ``at`` (atomically, as a deployment's symlink swap does)."""
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(at)
    os.replace(tmp, link)


def _opt(w: Worker, name: str) -> str | None:
    """The value of the worker's option ``name``, if it has it."""
    return w.opts[w.opts.index(name) + 1] if name in w.opts else None


def _fired(w: Worker, r: dict) -> dict[str, bool]:
    """Whether each fault drawn for ``w`` happened in its run ``r``."""
    workers = r["workers"]
    total = {k: sum(x[k] for x in workers) for k in workers[0]}
    # Faults on loads can happen only where the worker loaded (whether it finds pages
    # depends on what earlier workers' faults left); the schedule's last worker must load.
    loaded = r["scheduler"]["external_tokens"] > 0
    seen = {
        "short_loads": r["faults"]["short_load"] > 0 or not loaded,
        "drop_saves": r["faults"]["drop_save"] > 0,
        "preempt": r["vllm_stats"]["preemptions"] > 0,
        "fail_copy": total["load_error_pages"] > 0 or not loaded,
        # A Load past its deadline needs a load (seed 534688829: nothing to find after
        # every earlier worker's agent was killed).
        "time_out": total["retired_staging"] > 0
        or (_opt(w, "--time-out") == "load" and not loaded),
        # A late save is one that was sent: some page saved or given up.
        "slow_save": w.role == "kv_consumer" or any(total[k] for k in SAVE_OUTCOMES),
        # A save went out past the connector's wait for the preempted request's blocks.
        "late_save": r["faults"]["late_save"] > 0,
        "abort": r["faults"]["abort"] > 0,
        "stall": r["faults"]["stall"] > 0 or not loaded,
        "kill": r["vllm_stats"]["killed"],
        "daemon_stop": r["vllm_stats"]["killed"],
        "daemon_kill": r["vllm_stats"]["killed"],
    }
    return {f: seen[f] for f in w.faults}


def run_schedule(s: Schedule, tmp: Path, log=print) -> dict:
    """Runs every worker of ``s`` in turn against one kvtierd and one agent per TP rank;
    returns what each reported and the problems found (empty: the schedule passed)."""
    sets = [f"l2.pool_pages={s.l2_pages}"]
    if s.l3_delay is not None:
        sets += [f"l3.fault_get_delay={s.l3_delay[0]}", f"l3.fault_set_delay={s.l3_delay[1]}"]
    d = Kvtierd(tmp / "daemon", *sets)
    versions, lora_link = _adapters(tmp)
    agents_dir = tmp / "agents"
    agents_dir.mkdir(exist_ok=True)

    # A stalled kvtierd answers the agents after the Loads' deadlines but before their own
    # (the stall fault resumes it within 8 s).
    sets_a = ["daemon.timeout=10s"] if any("stall" in w.faults for w in s.workers) else []

    def start_agent(rank: int) -> Agent:
        return Agent(
            tmp, f"agent-{rank}", d.socket, *sets_a, socket=agents_dir / f"agent-{rank}.sock"
        )

    agents = [start_agent(r) for r in range(s.tp * s.pp)]
    problems: list[str] = []
    runs = []
    plan = list(enumerate(s.workers))
    if s.readback_from_l3:
        plan.append((len(s.workers) - 1, replace(s.workers[-1], name="check-l3")))
    try:
        for i, w in plan:
            prompts = w.prompts
            if w.name.startswith("check"):
                prompts = _with_outputs(w.prompts, runs)
            if w.name == "check-l3":
                # A graceful stop flushes the backups; the new kvtierd's L2 starts empty.
                d.stop()
                for a in agents:
                    a.wait_daemon(connected=False)
                d.start()
                for a in agents:
                    a.wait_daemon(connected=True)
            opts = list(w.opts)
            if s.tp > 1:
                opts += ["--tp", str(s.tp)]
            if s.pp > 1:
                opts += ["--pp", str(s.pp)]
            if s.mla:
                opts.append("--mla")
            if s.lora is not None:
                _point(lora_link, versions[s.lora[i]])
                opts += ["--lora", f"a={lora_link}"]
            opts += ["--seed", str(s.seed * 100 + i)]
            if "stall" in w.faults:
                opts += ["--stall-load", str(d.proc.pid)]
            kill = None
            if w.kill is not None:
                kill = f"{agents[w.kill[0]].proc.pid}@{w.kill[1]}"
            disturbed = None
            if w.daemon is not None:
                kind, step, secs = w.daemon
                flag_ = "--stop" if kind == "stop" else "--kill"
                opts += [flag_, f"{d.proc.pid}@{step}"]
                disturbed = _Disturbed(d, kind, secs)
            # Calls that hang (a killed agent, a full L2) cost seconds, not the default 10.
            extra = {"timeout_s": 4.0, **w.extra}
            if "--time-out" in opts or "stall" in w.faults:
                extra["timeout_s"] = 2.0
            kv = flag(str(agents_dir / "agent-{local_rank}.sock"), w.role, **extra)
            t0 = time.monotonic()
            try:
                r = finish_worker(*start_worker(tmp, w.name, kv, prompts, *opts, kill=kill))
            finally:
                if disturbed is not None:
                    disturbed.end()
            r["seconds"] = time.monotonic() - t0
            runs.append(r)
            if w.kill is not None and r["vllm_stats"]["killed"]:
                agents[w.kill[0]].proc.wait(10)
                agents[w.kill[0]] = start_agent(w.kill[0])
            if r["wrong_blocks"]:
                problems.append(f"{w.name}: {r['wrong_blocks']} wrong blocks")
            if r["overwritten_blocks"]:
                problems.append(
                    f"{w.name}: {r['overwritten_blocks']} blocks written after vLLM gave them "
                    "to another request"
                )
            total = {k: sum(x[k] for x in r["workers"]) for k in r["workers"][0]}
            # Pages the reader can find: saved by workers that were not disturbed (a kill
            # may take what is not yet in L3), under its LoRA adapter's weights.
            findable = sum(
                x["saved_pages"]
                for j, run in enumerate(runs[:-1])
                if s.workers[j].kill is None
                and s.workers[j].daemon is None
                and (s.lora is None or s.lora[j] == s.lora[i])
                for x in run["workers"]
            )
            if (
                w.name.startswith("check")
                and findable
                and not (r["scheduler"]["external_tokens"] and total["loaded_pages"])
            ):
                problems.append(f"{w.name}: vacuous: loaded nothing")
            if w.name == "check-l3":
                # Every page from L3: the restarted kvtierd took over none of the old L2.
                adopted = d.metric('kvtier_l2_takeover_pages_total{outcome="adopted"}', 0.0)
                landed = d.metric('kvtier_prefetch_pages_total{stage="landed"}', 0.0)
                if adopted:
                    problems.append(f"{w.name}: kvtierd took over {adopted:.0f} L2 pages")
                if findable and not landed:
                    problems.append(f"{w.name}: vacuous: no page landed from L3")
            # An agent or kvtierd gone from an early step may be gone for the rest of the run.
            gone = "kill" in w.faults or w.daemon is not None
            # Aborts spare a worker's first request, but a stall aborts the request whose Load
            # it stalled, which may be that one (the 30-minute run's seed 961198079).
            every_one_aborted = r["faults"]["abort"] >= len(prompts)
            if (
                w.role != "kv_consumer"
                and not total["saved_pages"]
                and not gone
                and not every_one_aborted
            ):
                problems.append(f"{w.name}: vacuous: saved nothing")
            for f, seen in _fired(w, r).items():
                if not seen:
                    problems.append(f"{w.name}: vacuous: fault {f} never happened")
            if "--async-scheduling" in w.opts and not r["vllm_stats"]["overlapped_steps"]:
                problems.append(f"{w.name}: vacuous: async scheduling never overlapped a step")
            log(
                f"  {w.name} {w.role}: {r['steps']} steps, {r['checked_blocks']} blocks checked, "
                f"{r['scheduler']['external_tokens']} external tokens, "
                f"{total['saved_pages']} saved, {r['load_error_blocks']} load errors, "
                f"faults {w.faults} {r['faults']}, {r['seconds']:.1f} s"
            )
    finally:
        for a in agents:
            a.stop()
        d.stop()
    return {"runs": runs, "problems": problems}


def _with_outputs(check: list[dict], runs: list[dict]) -> list[dict]:
    """The reader's prompts (``check-<id>``), each followed by the tokens the request
    ``<id>`` generated in an earlier worker: its decode pages are read back too."""
    outputs = {rid: out for r in runs for rid, out in r["outputs"].items()}
    return [
        dict(p, tokens=p["tokens"] + outputs.get(p["id"].removeprefix("check-"), [])) for p in check
    ]


class _Disturbed:
    """kvtierd under a worker that stops (SIGSTOP) or kills (SIGKILL) it at a step: once it
    is stopped or gone, this resumes or restarts it (same directory: the restart takes over
    its L2 pool, and its file L3 is still there) ``secs`` later."""

    def __init__(self, d: Kvtierd, kind: str, secs: float):
        self.d, self.kind, self.secs = d, kind, secs
        self.pid = d.proc.pid
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _hit(self) -> bool:
        if self.kind == "kill":
            return self.d.proc.poll() is not None
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def _run(self) -> None:
        while not self._hit():
            if self.done.wait(0.02):
                return
        time.sleep(self.secs)
        if self.kind == "stop":
            os.kill(self.pid, signal.SIGCONT)
        else:
            self.d.start()

    def end(self) -> None:
        """After the worker: waits for the resume or restart, if the step came."""
        self.done.set()
        self.thread.join(60)


def events(report: dict) -> dict[str, int]:
    """What a schedule's runs went through, summed."""
    out = {"steps": 0, "blocks": 0, "loaded": 0, "saved": 0, "load_errors": 0, "preemptions": 0}
    for r in report["runs"]:
        out["steps"] += r["steps"]
        out["blocks"] += r["checked_blocks"]
        out["loaded"] += sum(x["loaded_pages"] for x in r["workers"])
        out["saved"] += sum(x["saved_pages"] for x in r["workers"])
        out["load_errors"] += r["load_error_blocks"]
        out["preemptions"] += r["vllm_stats"]["preemptions"]
        for k, v in r["faults"].items():
            out[k] = out.get(k, 0) + v
    return out


def fuzz_one(seed: int, tmp: Path | None = None, log=print) -> dict:
    s = make_schedule(seed)
    log(s.describe())
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix=f"kvtier-fuzz-{seed}-") as d:
            return run_schedule(s, Path(d), log)
    return run_schedule(s, tmp, log)


def main() -> int:
    return fuzzing.main(__doc__.split("\n\n")[0], "tests/vllm/fuzz.py", fuzz_one, events)


if __name__ == "__main__":
    sys.exit(main())
