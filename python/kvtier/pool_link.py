"""One kvtierd session per engine host pool, and the page moves over it: the part every
integration that copies pages between an engine's host memory and kvtierd's pool shares.

SGLang's :class:`~kvtier.integrations.sglang.KvtierStorage` holds one :class:`PoolLink` for
the KV pool and one per hybrid pool (a Mamba state, a sliding-window copy, an indexer cache):
each pool has its own page size, so its own kvtierd layout, fingerprint and shared-memory
pool. vLLM's secondary tier (``kvtier.integrations.vllm.tier``) holds one for the rows of
vLLM's CPU region. A link registers its session on first use, again after kvtierd comes back,
and never raises into the engine's threads' callers: a failure is a miss, counted by its
:class:`Reporter`.

How a page's bytes reach a slot is the caller's :class:`Pages`: SGLang's pointer lists for the
KV pool, a pool's flat data pages, vLLM's region rows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from kvtier.host import DaemonClient, HostSession, KvtierError
from kvtier.keys import Namespace
from kvtier.v1 import common_pb2

T = TypeVar("T")


class UnsupportedPool(ValueError):
    """The host pool's shape or layout has no kvtier page equivalent."""


class Pages(Protocol):
    """The host pool pages of one call, in key order."""

    def to_slot(self, i: int, base: int) -> None:
        """Copies page ``i`` into the slot at address ``base``."""

    def from_slot(self, i: int, base: int) -> None:
        """Copies the slot at address ``base`` into page ``i``."""


class Reporter:
    """Counters of what happened, and failure logs at most once per interval per reason."""

    def __init__(self, log_interval_s: float, logger: logging.Logger):
        self.log_interval_s = log_interval_s
        # The integration's logger: the link's lines go where the engine's user looks.
        self.logger = logger
        self.counters: Counter = Counter()
        self.lock = threading.Lock()
        self._logged: dict[str, float] = {}

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def fail(self, reason: str, e: BaseException) -> None:
        self.bump(f"error:{reason}")
        now = time.monotonic()
        with self.lock:
            if now - self._logged.get(reason, -1e9) < self.log_interval_s:
                return
            self._logged[reason] = now
        self.logger.warning("kvtier: %s failed (counted as a miss): %s", reason, e)


class PoolLink:
    """kvtierd's session for one host pool (one layout)."""

    def __init__(
        self,
        label: str,
        client: DaemonClient,
        descriptor: common_pb2.LayoutDescriptor,
        page_bytes: int,
        namespace: Namespace,
        session_name: str,
        reporter: Reporter,
        settings,
    ):
        self.label = label
        self.client = client
        self.descriptor = descriptor
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.session_name = session_name
        self.report = reporter
        self.settings = settings
        self._session: HostSession | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0

    # ---- the session ----------------------------------------------------------------

    def session(self) -> HostSession | None:
        """The session, registering one when there is none (at most once per
        reconnect_interval_s while kvtierd cannot be reached)."""
        s = self._session
        if s is not None and not s.closed:
            return s
        with self._lock:
            s = self._session
            if s is not None and not s.closed:
                return s
            if time.monotonic() < self._retry_at:
                return None
            try:
                s = HostSession.register(
                    self.client, self.session_name, self.descriptor, self.namespace
                )
            except KvtierError as e:
                self._retry_at = time.monotonic() + self.settings.reconnect_interval_s
                self.report.fail("connect", e)
                return None
            if s.page_bytes != self.page_bytes:
                s.close()
                raise UnsupportedPool(
                    f"kvtierd derived {s.page_bytes}-byte pages from the {self.label} layout, "
                    f"the host pool has {self.page_bytes}"
                )
            s.start_heartbeats()
            self._session = s
            self.report.bump("sessions")
            self.report.logger.info(
                "kvtier: %s session %s on %s (pool %s)",
                self.label,
                s.label,
                self.client.address,
                s.pool.path,
            )
            return s

    def drop(self, s: HostSession, e: BaseException) -> None:
        """Gives up a session the daemon no longer serves; the next call registers anew."""
        if isinstance(e, KvtierError) and (e.session_lost or e.retryable):
            with self._lock:
                if self._session is s:
                    self._session = None
            s.abandon()

    @contextlib.contextmanager
    def use(self) -> Iterator[HostSession | None]:
        """The live session, its pool held mapped for the block; None when kvtierd cannot be
        reached."""
        with contextlib.ExitStack() as stack:
            s = self.session()
            if s is not None:
                try:
                    stack.enter_context(s.in_use())
                except KvtierError as e:
                    self.drop(s, e)
                    s = None
            yield s

    def close(self) -> None:
        with self._lock:
            s, self._session = self._session, None
        if s is not None:
            s.close()

    # ---- lookups ----------------------------------------------------------------------

    def _ask(self, what: str, call: Callable[[HostSession], T], miss: T) -> T:
        with self.use() as s:
            if s is None:
                return miss
            try:
                return call(s)
            except Exception as e:  # noqa: BLE001 - never into SGLang's thread
                self.report.fail(what, e)
                self.drop(s, e)
                return miss

    def leading(self, keys: list[bytes]) -> int:
        """Leading keys kvtierd holds in L2 or L3."""
        if not keys:
            return 0

        def call(s: HostSession) -> int:
            ready, storage = s.lookup(keys, include_storage=True)
            return min(ready + storage, len(keys))

        return self._ask("exists", call, 0)

    def present(self, keys: list[bytes]) -> list[bool]:
        """Key by key, whether kvtierd holds each in L2 or L3."""
        if not keys:
            return []
        return self._ask(
            "exists", lambda s: s.lookup_each(keys, include_storage=True), [False] * len(keys)
        )

    # ---- writes -----------------------------------------------------------------------

    def store(self, pages: Pages, keys: list[bytes], parent: bytes) -> tuple[list[bool], int]:
        """Writes pages into L2 (kvtierd writes them on to L3 per its policy): which keys are
        stored, and how many pages this call copied. When L2 has no room (its pages wait for
        L3 writes), the call waits for L3 to drain and tries the rest again, up to
        ``timeout_s``: a burst faster than L3 is backpressure, not loss. Pages still refused
        then are False, counted as ``set_no_space``."""
        n = len(keys)
        ok = [False] * n
        copied = done = 0
        deadline = time.monotonic() + self.settings.timeout_s
        pause = 0.002
        waited = False
        while True:
            with self.use() as s:
                if s is None:
                    self.report.bump("set_unavailable", n - done)
                    return ok, copied
                r = self._store_in(s, pages, keys, keys[done - 1] if done else parent, done, ok)
            if r is None:
                return [False] * n, 0
            upto, c = r
            copied += c
            done = upto
            if done == n:
                return ok, copied
            now = time.monotonic()
            if now >= deadline:
                self.report.bump("set_no_space", n - done)
                return ok, copied
            if not waited:
                self.report.bump("set_waits")
                waited = True
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.05)

    def _store_in(
        self, s: HostSession, pages: Pages, keys: list[bytes], parent: bytes, start: int, ok
    ) -> tuple[int, int] | None:
        """Reserve, copy, Commit for ``keys[start:]``, setting ``ok``: how far the stored
        prefix now reaches (short of the end when L2 had no room) and how many pages were
        copied; None on a failure (the reserved slots are aborted, never left to the
        session's expiry, and the whole batch is False)."""
        try:
            r = s.store(keys[start:], lambda j, addr: pages.to_slot(start + j, addr), parent)
            for j in r.copied + r.present:
                ok[start + j] = True
            upto = start + r.held
            if r.present:
                self._confirm_present(s, keys[start:upto], ok, start)
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self.report.fail("set", e)
            self.drop(s, e)
            return None
        return upto, len(r.copied)

    def _confirm_present(
        self, s: HostSession, keys: list[bytes], ok: list[bool], offset: int
    ) -> None:
        """Keys Reserve called present may still be in another client's hands, not yet
        visible (and that client may give them up). Waits, up to timeout_s, until every key
        this call reports stored is visible in L2 or L3; a key that never shows is False.
        ``keys`` are ``ok[offset:]``'s."""
        want = [k for k, good in zip(keys, ok[offset:]) if good]
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            seen = s.lookup_each(want, include_storage=True)
            if all(seen):
                return
            if time.monotonic() >= deadline:
                missing = {k for k, v in zip(want, seen) if not v}
                for i, k in enumerate(keys):
                    if k in missing:
                        ok[offset + i] = False
                self.report.bump("set_not_visible", len(missing))
                return
            time.sleep(0.005)

    @property
    def page_tokens(self) -> int:
        return int(self.descriptor.page_size) or 1

    # ---- reads ------------------------------------------------------------------------

    def load(self, pages: Pages, keys: list[bytes], parent: bytes) -> int:
        """Copies the longest available prefix of ``keys`` into the host pool: L2 first, then
        what kvtierd loads from L3. Returns how many pages arrived."""
        with self.use() as s:
            if s is None:
                self.report.bump("get_unavailable", len(keys))
                return 0
            try:
                got = self._copy_out(s, s.acquire(keys), keys, pages, 0)
                if got < len(keys):
                    prev = keys[got - 1] if got else parent
                    got += self._from_storage(s, keys, pages, got, prev)
            except Exception as e:  # noqa: BLE001 - never into SGLang's thread
                self.report.fail("get", e)
                self.drop(s, e)
                return 0
        return got

    def _copy_out(
        self, s: HostSession, slots: list[int], keys: list[bytes], pages: Pages, first: int
    ) -> int:
        """Copies pinned slots into pages ``first..``, then releases them (the session's page
        protocol): a failed Release raises, since the bytes are void."""
        return s.read_pinned(keys[first:], slots, lambda i, addr: pages.from_slot(first + i, addr))

    def _from_storage(
        self, s: HostSession, keys: list[bytes], pages: Pages, first: int, parent: bytes
    ) -> int:
        rid = uuid.uuid4().hex
        # SGLang has already decided to load these pages (batch_exists, its own threshold):
        # the daemon's threshold and load-or-recompute test are turned off for the call. The
        # wait is SGLang's own prefetch budget, so one slow L3 read never holds SGLang's
        # single prefetch thread past what SGLang itself would wait: kvtierd stops at the
        # budget and hands over what landed.
        budget = self.settings.load_budget_s(len(keys) - first, self.page_tokens)
        policy = self.settings.prefetch_policy
        if policy == "wait_complete":
            policy = "timeout"
        progress = s.prefetch(
            rid,
            keys[first:],
            parent,
            policy,
            timeout_ms=max(1, int(budget * 1000)),
            threshold_tokens=0,
            recompute_tokens_per_second=1,
            timeout=budget + self.settings.timeout_s,
        )
        if progress.state == "revoked":
            # Nothing was allocated or pinned, and the prefetch is closed.
            self.report.bump(f"prefetch_revoked:{progress.reason}")
            return 0
        try:
            progress, slots = s.take_prefetch(rid)
        except KvtierError:
            try:
                s.release_prefetch(rid)
            except KvtierError:
                pass
            raise
        if progress.state == "failed":
            self.report.bump(f"prefetch_failed:{progress.reason}")
        return self._copy_out(s, slots, keys, pages, first)
