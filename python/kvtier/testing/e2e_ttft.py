"""Time to first token with kvtier against recomputing the prompt (``benches/e2e_ttft.py``
is the command; ``python/tests/test_e2e_ttft.py`` runs its CPU twin; ``scripts/gpu-check
--e2e`` runs it on a GPU).

One node: a kvtierd (file L3, write-through) and two kvtier-agents. A *reader* (this
process) and a *writer* (a second process running this module with ``--role writer``) each
hold the same seeded model (:mod:`kvtier.testing.e2e_model`) and a vLLM-shaped paged KV
cache registered with its own agent. For each prompt length:

1. **recompute**: the reader prefills the whole prompt into its cache (the reference
   blocks) and produces the first token's logits;
2. the writer computes the same prompt and saves its full pages through its agent
   (``save_pages``: the agent copies them out of the writer's cache into L2), and kvtierd
   writes them through to its file L3;
3. **L2 hit**: the reader looks the prompt up, has its agent load the prompt's full pages
   (all but a last token, at least) into free blocks (``load_pages``), computes the tail
   over them and produces the first token's logits;
4. **L3 hit**: kvtierd is stopped (SIGTERM: its L2 pool is unlinked) and started again on
   the same data directory, whose file L3 still holds the pages; the reader looks up and
   loads again (the agent's Load prefetches from L3 into L2 and copies, ``wait_complete``),
   then computes the tail.

Each TTFT is wall time from the request's tokens to the logits on the host side of a
device sync. Every hit is checked: the loaded blocks equal the reader's own reference
blocks bit for bit (int16 views), and the logits match the recompute's (exactly, or within
the dtype's tolerance: the tail's matrices have other shapes than the whole prompt's, so
their kernels may round differently). A failed check fails the run.

kvtierd's load-versus-recompute revocation (``prefetch.recompute_tokens_per_second``) and
its minimum prefetch (``prefetch.threshold_tokens``) are turned off here, so the L3 row
always measures a load; the file L3 reads through the page cache unless ``--l3-io direct``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import IO, Any, NoReturn

import torch

from kvtier._rpc import KvtierError
from kvtier.agent import AgentClient, Saved
from kvtier.keys import Namespace
from kvtier.testing.e2e_model import PRESETS, KvCache, Model, Preset, prompt_tokens, sync
from kvtier.testing.processes import Agent, Kvtierd

NAMESPACE = Namespace(tenant="e2e-ttft")
# The page the reader saves after kvtierd restarts, so that its agent's new link (and, on
# a GPU, the new pool's registration with the driver) is in place before a timed load.
WARM_NAMESPACE = Namespace(tenant="e2e-ttft-warm")
# What the published systems report (their runs, their hardware), beside which the table
# puts this run's ratios: hit TTFT / recompute TTFT.
PUBLISHED = "LMCache MP 0.29 s vs 3.98 s = 0.073x; PegaFlow 0.107x"
# How long one step (a writer's prefill and save, a load) may take before the run gives up,
# naming it.
STEP_TIMEOUT_S = 600.0

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def logits_tolerance(p: Preset) -> float:
    """The largest |difference| / max |reference| accepted between a hit's logits and the
    recompute's: the tail is computed by matrix products of other shapes than the whole
    prompt's, which round differently in the last bits of the dtype."""
    return {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}[p.dtype]


def daemon_settings(p: Preset, l3_io: str) -> list[str]:
    """kvtierd's settings for a run: room in L2 for the longest prompt's pages (a prefetch
    may take 95% of the pool; the pages of the prompt before are in L3 by then, so they make
    room), every page written through to the file L3, and loads from L3 never turned down
    as not worth it."""
    pages = math.ceil(max(p.prompts) / p.block_size)
    return [
        f"l2.pool_pages={math.ceil(pages / 0.9) + 64}",
        # The writer saves a whole prompt at once; kvtierd writes it to L3 behind.
        "l2.dirty_fraction=1.0",
        "prefetch.budget_fraction=0.95",
        "prefetch.threshold_tokens=0",
        "prefetch.recompute_tokens_per_second=0",
        "prefetch.policy=wait_complete",
        "l3.backend=file",
        "l3.write_policy=write_through",
        f"l3.file.io={l3_io}",
    ]


AGENT_SETTINGS = ("daemon.timeout=60s",)


class Node:
    """kvtierd and the reader's and writer's agents, each on ``root``."""

    def __init__(self, root: Path, p: Preset, l3_io: str) -> None:
        self.daemon = Kvtierd(root / "daemon", *daemon_settings(p, l3_io))
        self.agents: list[Agent] = []
        try:
            self.reader = self._agent(root, "reader")
            self.writer = self._agent(root, "writer")
        except BaseException:
            self.stop()
            raise

    def _agent(self, root: Path, name: str) -> Agent:
        a = Agent(root, name, self.daemon.socket, *AGENT_SETTINGS)
        self.agents.append(a)
        return a

    def l3_written(self) -> int:
        """Pages this kvtierd run has sent to L3 and L3 holds (written, or there already)."""
        return sum(
            int(self.daemon.metric(f'kvtier_l3_writes_total{{outcome="{o}"}}', absent=0.0))
            for o in ("written", "present")
        )

    def wait_l3(self, pages: int, timeout: float = STEP_TIMEOUT_S) -> None:
        """Waits until this kvtierd run has sent ``pages`` pages to L3 (it writes behind
        L2)."""
        deadline = time.monotonic() + timeout
        while (have := self.l3_written()) < pages:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"kvtierd wrote {have} of {pages} pages to its file L3 in {timeout} s"
                )
            time.sleep(0.05)

    def restart_daemon(self) -> None:
        """Stops kvtierd (SIGTERM: it drains, unlinks its L2 pools) and starts it again on
        the same data directory: L2 empty, the file L3 as it was."""
        self.daemon.stop()
        self.daemon.start()

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        self.daemon.stop()


def save_until_stored(
    client: AgentClient,
    tokens: Sequence[int],
    ns: Namespace,
    blocks: Sequence[int],
    timeout: float = 60.0,
) -> Saved:
    """``save_pages`` of ``blocks`` (pages 0..), again while the agent reports pages it could
    not save or cannot reach kvtierd (a link that a restart broke, before the agent noticed):
    every page is in L2 on return. ``stored`` counts the pages copied into L2 over all the
    tries, ``present`` those found there. Raises TimeoutError naming the last answer."""
    deadline = time.monotonic() + timeout
    stored = 0
    while True:
        try:
            r = client.save_pages(tokens, ns, 0, list(blocks), timeout=STEP_TIMEOUT_S)
            stored += r.stored
            if r.stored + r.present == len(blocks) and not r.failed:
                return Saved(stored, len(blocks) - stored, 0, 0)
            last = f"{r}"
        except KvtierError as e:
            if not e.retryable:
                raise
            last = f"{e}"
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"saving {len(blocks)} pages: the agent answered {last} for {timeout} s"
            )
        time.sleep(0.05)


def _wait_linked(client: AgentClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.stats().daemon_connected:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the agent at {client.address} did not link to kvtierd in {timeout} s"
            )
        time.sleep(0.05)


# ----------------------------------------------------------------------------- the writer


def writer_main(spec: str, agent_socket: str, threads: int) -> int:
    """The writer process: the same model and cache as the reader, its own agent. Reads
    commands on stdin (``save N``: compute the N-token prompt and save its full pages;
    ``quit``) and answers each with one ``E2E {json}`` line on stdout."""
    p = Preset.from_json(json.loads(spec))
    if threads > 0:
        torch.set_num_threads(threads)
    pages = math.ceil(max(p.prompts) / p.block_size)
    model = Model(p)
    cache = KvCache(p, pages + 1)
    client = AgentClient(agent_socket, timeout=60)
    cache.register(client)
    _wait_linked(client)
    dev = cache.buffer.device
    print("E2E " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] != "save" or len(cmd) != 2:
            raise ValueError(f"writer: unknown command {line.strip()!r}")
        n = int(cmd[1])
        tokens = prompt_tokens(p, n)
        table = torch.arange(math.ceil(n / p.block_size), device=dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.forward(torch.tensor(tokens, device=dev), 0, table, cache)
        sync(p.device)
        t1 = time.perf_counter()
        full = n // p.block_size
        r = save_until_stored(client, tokens, NAMESPACE, range(full))
        t2 = time.perf_counter()
        answer = {
            "prompt": n,
            "pages": full,
            "stored": r.stored,
            "present": r.present,
            "compute_s": t1 - t0,
            "save_s": t2 - t1,
            # Of the pages a reader loads (all but the last token's).
            "digest": cache.digest(list(range((n - 1) // p.block_size))),
        }
        print("E2E " + json.dumps(answer), flush=True)
    client.close()
    return 0


@dataclass(frozen=True)
class WriterAnswer:
    """What the writer did with a prompt: its full pages, how many its agent copied into
    L2 (and found there), its prefill's and its save's seconds, and the digest of the pages
    a reader loads (:meth:`KvCache.digest`)."""

    prompt: int
    pages: int
    stored: int
    present: int
    compute_s: float
    save_s: float
    digest: str


class Writer:
    """The writer process, spoken to over its stdin and stdout."""

    def __init__(self, p: Preset, agent_socket: str) -> None:
        import kvtier

        pkg_root = str(Path(kvtier.__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (pkg_root, env.get("PYTHONPATH")) if x)
        args = [
            sys.executable,
            "-m",
            "kvtier.testing.e2e_ttft",
            "--role",
            "writer",
            "--spec",
            json.dumps(p.to_json()),
            "--agent",
            agent_socket,
            # The reader's thread count: CPU kernels may split work by it, and the pages
            # must come out bit for bit as the reader computes them.
            "--threads",
            str(torch.get_num_threads()),
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        out = self.proc.stdout
        assert out is not None, "started with stdout=PIPE"
        threading.Thread(target=self._pump, args=(out,), daemon=True).start()
        try:
            self.answer("start")
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _pump(self, out: IO[str]) -> None:
        for line in out:
            if line.startswith("E2E "):
                self.lines.put(line[4:])
        self.lines.put(None)

    def answer(self, what: str, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the writer did not answer {what!r} in {timeout} s") from None
        if line is None:
            code = self.proc.wait(10)
            raise RuntimeError(f"the writer exited with status {code} before answering {what!r}")
        return json.loads(line)

    def save(self, n: int) -> WriterAnswer:
        """Has the writer compute the ``n``-token prompt and save its full pages."""
        stdin = self.proc.stdin
        assert stdin is not None, "started with stdin=PIPE"
        stdin.write(f"save {n}\n")
        stdin.flush()
        a = self.answer(f"save {n}")
        return WriterAnswer(
            prompt=int(a["prompt"]),
            pages=int(a["pages"]),
            stored=int(a["stored"]),
            present=int(a["present"]),
            compute_s=float(a["compute_s"]),
            save_s=float(a["save_s"]),
            digest=str(a["digest"]),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------------------- the reader


@dataclass(frozen=True)
class Hit:
    """One request served from kvtier: what the lookup said, how many pages loaded, and
    the times (seconds) of lookup + load, of the tail's prefill, and both."""

    tier: str
    lookup_l2: int
    lookup_l3: int
    pages: int
    load_s: float
    tail_s: float
    logits: torch.Tensor

    @property
    def total_s(self) -> float:
        return self.load_s + self.tail_s


@dataclass(frozen=True)
class Verdict:
    """A hit checked against the recompute."""

    expected_pages: int
    loaded_pages: int
    # (layer, page) of every loaded page whose bytes differ from the reference's.
    differing: list[tuple[int, int]]
    # The loaded pages' digest equals the writer's (else the transfer changed them).
    matches_writer: bool
    logits_exact: bool
    logits_max_diff: float
    logits_tolerance: float
    same_first_token: bool
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Row:
    """One prompt length: its loaded pages, the median recompute, the median hits, and
    every hit's check (timed or not)."""

    prompt: int
    pages: int
    recompute_s: float
    l2: Hit
    l3: Hit
    verdicts: list[tuple[str, Verdict]]

    @property
    def ok(self) -> bool:
        return all(v.ok for _, v in self.verdicts)


def median_by(hits: list[Hit]) -> Hit:
    """The hit of median total time (the upper one of an even count)."""
    return sorted(hits, key=lambda h: h.total_s)[len(hits) // 2]


class Bench:
    """The reader's side of a run, over a node it starts on ``root``."""

    def __init__(self, p: Preset, root: Path, l3_io: str = "buffered", log: Log = _stderr) -> None:
        self.preset, self.log = p, log
        self.max_pages = math.ceil(max(p.prompts) / p.block_size)
        log(f"e2e: starting kvtierd and two agents in {root}")
        self.node = Node(root, p, l3_io)
        self.writer: Writer | None = None
        self.client: AgentClient | None = None
        self._threads = torch.get_num_threads()
        try:
            if p.threads:
                torch.set_num_threads(p.threads)
            log(f"e2e: drawing the {p.name} model (seed {p.seed}) on {p.device}")
            self.model = Model(p)
            # Reference blocks (the recompute's), free blocks (a hit's), one spare.
            self.cache = KvCache(p, 2 * self.max_pages + 1)
            self.reference = list(range(self.max_pages))
            self.free = list(range(self.max_pages, 2 * self.max_pages))
            self.spare = 2 * self.max_pages
            self.client = AgentClient(self.node.reader.socket, timeout=60)
            self.info = self.cache.register(self.client)
            _wait_linked(self.client)
            log("e2e: starting the writer process")
            self.writer = Writer(p, self.node.writer.socket)
        except BaseException:
            self.close()
            raise
        self.writer_digests: dict[int, str] = {}
        self._warms = 0

    @property
    def device(self) -> torch.device:
        return self.cache.buffer.device

    def _agent(self) -> AgentClient:
        assert self.client is not None, "the bench is closed"
        return self.client

    def warm_up(self) -> None:
        """Runs each path once on a short prompt (kernel selection, allocator) untimed."""
        p = self.preset
        n = min(p.prompts)
        tokens = torch.tensor(prompt_tokens(p, n), device=self.device)
        with torch.inference_mode():
            self.model.forward(tokens, 0, torch.tensor(self.free, device=self.device), self.cache)
            bs = p.block_size
            self.model.forward(
                tokens[-bs:], n - bs, torch.tensor(self.free, device=self.device), self.cache
            )
        sync(p.device)

    def recompute(self, n: int) -> tuple[float, torch.Tensor]:
        """The whole prompt computed into the reference blocks: (seconds, logits)."""
        p = self.preset
        tokens = prompt_tokens(p, n)
        sync(p.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            table = torch.tensor(self.reference, device=self.device)
            logits = self.model.forward(
                torch.tensor(tokens, device=self.device), 0, table, self.cache
            )
        sync(p.device)
        return time.perf_counter() - t0, logits

    def save(self, n: int) -> WriterAnswer:
        """The writer computes and saves the prompt; returns its answer once kvtierd has
        written the pages it stored through to L3."""
        assert self.writer is not None, "the bench is closed"
        before = self.node.l3_written()
        w = self.writer.save(n)
        if w.stored + w.present != n // self.preset.block_size:
            raise RuntimeError(f"the writer saved {w.stored + w.present} of {n} tokens' pages")
        self.writer_digests[n] = w.digest
        self.node.wait_l3(before + w.stored)
        return w

    def hit(self, n: int, tier: str) -> Hit:
        """A request for the prompt, its full pages (all but the last token's) loaded by the
        agent into free blocks, its tail computed over them. The free blocks are zeroed
        first (untimed), so no earlier load's bytes can pass for this one's."""
        p = self.preset
        c = self._agent()
        tokens = prompt_tokens(p, n)
        want = (n - 1) // p.block_size
        blocks = self.free[: math.ceil(n / p.block_size)]
        self.cache.zero(blocks)
        sync(p.device)
        t0 = time.perf_counter()
        look = c.lookup_pages(tokens, NAMESPACE)
        got = c.load_pages(
            tokens,
            NAMESPACE,
            0,
            blocks[:want],
            policy="wait_complete",
            timeout=STEP_TIMEOUT_S,
            owner=self.info.owner,
        )
        t1 = time.perf_counter()
        start = got.pages * p.block_size
        with torch.inference_mode():
            logits = self.model.forward(
                torch.tensor(tokens[start:], device=self.device),
                start,
                torch.tensor(blocks, device=self.device),
                self.cache,
            )
        sync(p.device)
        t2 = time.perf_counter()
        return Hit(tier, look.l2_pages, look.l3_pages, got.pages, t1 - t0, t2 - t1, logits)

    def verify(self, n: int, h: Hit, reference: torch.Tensor) -> Verdict:
        """Checks a hit: every page it should have loaded did, bit for bit the reader's
        own, and its logits match the recompute's (``reference``)."""
        p = self.preset
        want = (n - 1) // p.block_size
        problems: list[str] = []
        if h.pages != want:
            problems.append(f"{h.tier}: kvtier loaded {h.pages} of the prompt's {want} pages")
        # The lookup counts every full page of the prompt (the last one's too).
        full = n // p.block_size
        if h.tier == "L2" and h.lookup_l2 != full:
            problems.append(f"L2: the lookup found {h.lookup_l2} of {full} pages in L2")
        if h.tier == "L3" and (h.lookup_l2, h.lookup_l3) != (0, full):
            problems.append(
                f"L3: after kvtierd's restart the lookup found {h.lookup_l2} pages in L2 and "
                f"{h.lookup_l3} in L3 (want 0 and {full})"
            )
        loaded = self.free[: min(h.pages, want)]
        differing = self.cache.differences(loaded, self.reference[: len(loaded)])
        digest = self.cache.digest(self.free[:want])
        matches_writer = digest == self.writer_digests.get(n)
        if differing:
            layers = sorted({layer for layer, _ in differing})
            pages = sorted({page for _, page in differing})
            why = (
                "they are the writer's bytes: the writer's prefill computed other KV than "
                "the reader's"
                if matches_writer
                else "they are not the writer's bytes either: the transfer changed them"
            )
            problems.append(
                f"{h.tier}: {len(pages)} loaded pages (first: page {pages[0]}) differ from "
                f"the reader's recompute in layers {layers[:8]}; {why}"
            )
        exact = torch.equal(h.logits, reference)
        scale = float(reference.abs().max()) or 1.0
        diff = float((h.logits - reference).abs().max()) / scale
        tol = logits_tolerance(p)
        if not exact and not diff <= tol:
            problems.append(
                f"{h.tier}: the first token's logits differ from the recompute's by "
                f"{diff:.3g} of their largest (tolerance {tol:g})"
            )
        same = int(h.logits.argmax()) == int(reference.argmax())
        return Verdict(want, h.pages, differing, matches_writer, exact, diff, tol, same, problems)

    def restart_daemon(self) -> None:
        """kvtierd restarted with an empty L2, then a page saved through the reader's agent
        (untimed) so its new link is in place before a timed load."""
        self.node.restart_daemon()
        self._warms += 1
        warm = [self.preset.vocab - 1 - self._warms] * self.preset.block_size
        before = self.node.l3_written()
        r = save_until_stored(self._agent(), warm, WARM_NAMESPACE, [self.spare])
        # Its write to L3 landed too, so no write competes with the timed load.
        self.node.wait_l3(before + r.stored)

    def prompt(self, n: int) -> Row:
        """Every measurement of one prompt length, checked."""
        p, log = self.preset, self.log
        want = (n - 1) // p.block_size
        log(f"e2e: {n} tokens: recompute x{p.repeat + 1} (the first untimed)")
        self.recompute(n)
        times, logits = [], []
        for _ in range(p.repeat):
            s, lg = self.recompute(n)
            times.append(s)
            logits.append(lg)
        log(f"e2e: {n} tokens: recompute {', '.join(f'{t:.4f}' for t in times)} s")
        reference = logits[-1]
        if not all(torch.equal(x, reference) for x in logits):
            log(f"e2e: {n} tokens: note: repeated recomputes gave different logits")
        w = self.save(n)
        log(
            f"e2e: {n} tokens: the writer computed it in {w.compute_s:.3f} s and saved "
            f"{w.stored} pages ({w.present} already there) in {w.save_s:.3f} s"
        )
        verdicts: list[tuple[str, Verdict]] = []
        l2_hits: list[Hit] = []
        for i in range(p.repeat + 1):
            h = self.hit(n, "L2")
            verdicts.append(("L2", self.verify(n, h, reference)))
            if i:
                l2_hits.append(h)
        log(f"e2e: {n} tokens: L3 hits, kvtierd restarted before each (L2 emptied, L3 kept)")
        l3_hits: list[Hit] = []
        for _ in range(p.repeat):
            self.restart_daemon()
            h = self.hit(n, "L3")
            verdicts.append(("L3", self.verify(n, h, reference)))
            l3_hits.append(h)
        for _, v in verdicts:
            for problem in v.problems:
                log(f"e2e: {n} tokens: FAILED {problem}")
        l2, l3 = median_by(l2_hits), median_by(l3_hits)
        return Row(n, want, statistics.median(times), l2, l3, verdicts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.node.stop()
        torch.set_num_threads(self._threads)


# ----------------------------------------------------------------------------- the report


def describe(p: Preset) -> str:
    mib = p.page_bytes / (1 << 20)
    return (
        f"{p.name}: {p.layers} layers, hidden {p.hidden}, {p.heads} query heads, "
        f"{p.kv_heads} KV heads of {p.head_dim}, MLP {p.mlp}, vocabulary {p.vocab}, "
        f"{p.dtype} on {p.device}; blocks of {p.block_size} tokens (vLLM LBNHC), pages of "
        f"{mib:.3g} MiB"
    )


def goal_result(p: Preset, rows: list[Row]) -> tuple[bool, str] | None:
    """Whether the goal row is met, and the line that says so; None where the preset has
    no goal or the run did not measure its prompt."""
    if p.goal is None:
        return None
    n, most = p.goal
    row = next((r for r in rows if r.prompt == n), None)
    if row is None:
        return None
    ratio = row.l2.total_s / row.recompute_s
    met = ratio <= most
    return met, (
        f"goal: {n}-token prompt, L2 hit / recompute <= {most:g}x: {ratio:.3f}x "
        f"{'met' if met else 'MISS'}"
    )


def table(p: Preset, rows: list[Row]) -> str:
    """The report: one row per prompt, then what each hit's check found, the published
    multiples and the goal."""
    out = [
        f"e2e TTFT, {describe(p)}",
        f"median of {p.repeat}: recompute and L2 hit after one untimed run each, L3 hit "
        "with kvtierd restarted before each. Hit = lookup + load (agent DMA) + tail prefill.",
        "",
        f"{'prompt':>7} {'pages':>6} {'recompute s':>12} {'L2 hit s':>9} {'(load+tail)':>16} "
        f"{'L3 hit s':>9} {'(load+tail)':>16} {'L2/rec':>7} {'L3/rec':>7}",
    ]
    for r in rows:
        out.append(
            f"{r.prompt:>7} {r.pages:>6} {r.recompute_s:>12.4f} {r.l2.total_s:>9.4f} "
            f"{f'({r.l2.load_s:.4f}+{r.l2.tail_s:.4f})':>16} {r.l3.total_s:>9.4f} "
            f"{f'({r.l3.load_s:.4f}+{r.l3.tail_s:.4f})':>16} "
            f"{r.l2.total_s / r.recompute_s:>6.3f}x {r.l3.total_s / r.recompute_s:>6.3f}x"
        )
    out.append("")
    for r in rows:
        l2 = [v for t, v in r.verdicts if t == "L2"]
        l3 = [v for t, v in r.verdicts if t == "L3"]
        parts = []
        for name, vs in (("L2", l2), ("L3", l3)):
            if all(v.ok for v in vs):
                exact = all(v.logits_exact for v in vs)
                worst = max(v.logits_max_diff for v in vs)
                logits = "exact" if exact else f"within {worst:.1e} of max"
                same = "same" if all(v.same_first_token for v in vs) else "DIFFERENT"
                parts.append(
                    f"{name} x{len(vs)}: pages bit-identical, logits {logits}, first token {same}"
                )
            else:
                parts.append(f"{name}: FAILED " + "; ".join(x for v in vs for x in v.problems))
        out.append(f"{r.prompt:>7} tokens: " + " | ".join(parts))
    out.append("")
    out.append(f"published (their runs, hit / recompute TTFT): {PUBLISHED}")
    g = goal_result(p, rows)
    if g is not None:
        out.append(g[1])
    elif p.goal is None:
        out.append(f"goal: none for {p.name} (the goal is the GPU preset's 32k-token row)")
    else:
        out.append(f"goal: not measured (no {p.goal[0]}-token prompt in this run)")
    return "\n".join(out)


def run(p: Preset, root: Path, l3_io: str = "buffered", log: Log = _stderr) -> list[Row]:
    """Every prompt of the preset, measured and checked, on a node under ``root``."""
    bench = Bench(p, root, l3_io, log)
    try:
        bench.warm_up()
        return [bench.prompt(n) for n in p.prompts]
    finally:
        bench.close()


def _terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="e2e_ttft.py",
        description="Time to first token with kvtier (L2 and L3 hits) against recompute.",
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu-8b")
    ap.add_argument("--prompts", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeat", type=int, help="timed runs of recompute and L2 hit")
    ap.add_argument("--check", action="store_true", help="exit 1 when the goal is missed")
    ap.add_argument("--l3-io", choices=("buffered", "direct"), default="buffered")
    ap.add_argument("--workdir", help="where kvtierd and the agents keep their files")
    ap.add_argument("--role", choices=("reader", "writer"), default="reader")
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--agent", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "writer":
        if not (a.spec and a.agent):
            ap.error("--role writer needs --spec and --agent")
        return writer_main(a.spec, a.agent, a.threads)
    p = PRESETS[a.preset]
    if a.prompts:
        try:
            p = replace(p, prompts=tuple(int(x) for x in a.prompts.split(",")))
        except ValueError:
            ap.error(f"--prompts {a.prompts!r}: comma-separated token counts")
    if a.repeat is not None:
        p = replace(p, repeat=a.repeat)
    if p.repeat < 1 or any(n <= p.block_size for n in p.prompts):
        ap.error(f"--repeat must be at least 1 and every prompt longer than {p.block_size} tokens")
    if p.device == "cuda" and not torch.cuda.is_available():
        print(f"e2e_ttft: preset {p.name} needs a CUDA GPU and torch has none", file=sys.stderr)
        return 2
    if a.check and (p.goal is None or p.goal[0] not in p.prompts):
        ap.error(f"--check: preset {p.name} with these prompts has no goal row")
    # A step's time limit (scripts/gpu-check) ends the run with SIGTERM: stop the processes
    # and remove the pages on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="kvtier-e2e-"))
    try:
        rows = run(p, root, a.l3_io)
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(table(p, rows), flush=True)
    if not all(r.ok for r in rows):
        print("e2e_ttft: FAILED: a hit did not match the recompute (above)", file=sys.stderr)
        return 1
    g = goal_result(p, rows)
    if a.check and g is not None and not g[0]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
