"""kvtier as SGLang's HiCache L3 storage, through SGLang's ``dynamic`` storage backend.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": 1, "socket": "/run/kvtier/kvtierd.sock"}'

SGLang builds :class:`KvtierStorage` with its storage config, registers its host KV pool,
and (with ``interface_v1``) calls ``batch_set_v1`` / ``batch_get_v1`` with page keys and host
pool indices. Each call is a kvtierd session's Reserve/Commit or Acquire (then Prefetch from
L3)/Release; the page bytes are copied between SGLang's host pool and kvtierd's shared-memory
pool, never sent over gRPC. docs/sglang.md describes the settings and behaviour.

Nothing here raises into SGLang's threads: a failure (kvtierd down, a timeout, a page that
does not verify) is a miss or a ``False``, counted in :attr:`KvtierStorage.counters` and
logged at most once per ``log_interval_s`` per reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from kvtier import sglang_pages as pages
from kvtier.host import DTYPES, POLICIES, DaemonClient, HostSession, KvtierError
from kvtier.keys import Namespace
from kvtier.v1 import common_pb2, host_pb2

try:  # The base class SGLang checks for; absent only outside an SGLang install.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # pragma: no cover - exercised only without SGLang
    HiCacheStorage = object  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

# Keys of extra_config that belong to SGLang itself, not to this backend.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


@dataclass
class Settings:
    """The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``."""

    # kvtierd's gRPC socket (its `socket`, by default <data_dir>/kvtierd.sock).
    socket: str = "kvtier-data/kvtierd.sock"
    # Model identity in the layout fingerprint; empty: SGLang's model name.
    model_id: str = ""
    # A tenant name: pages are shared only among instances with the same one.
    namespace: str = ""
    # Deadline of each kvtierd call, in seconds.
    timeout_s: float = 5.0
    # How kvtierd finishes a load from L3: wait_complete, timeout or best_effort.
    prefetch_policy: str = "wait_complete"
    # Deadline of a whole load from L3 (the Prefetch call), in seconds.
    prefetch_timeout_s: float = 30.0
    # After kvtierd could not be reached, calls are misses for this long before the next try.
    reconnect_interval_s: float = 1.0
    # Least time between two log lines of the same failure.
    log_interval_s: float = 10.0

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(Settings)}
        s = Settings()
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        if unknown:
            logger.warning(
                "kvtier: ignoring unknown extra_config keys %s; kvtier's keys are %s",
                unknown,
                sorted(known),
            )
        for name in known:
            if name not in extra:
                continue
            v = extra[name]
            want = type(getattr(s, name))
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValueError(
                    f"kvtier extra_config key {name!r}: expected a {want.__name__}, got {v!r}"
                )
            setattr(s, name, v)
        if s.prefetch_policy not in POLICIES:
            raise ValueError(
                f"kvtier extra_config key 'prefetch_policy': {s.prefetch_policy!r} is not one "
                f"of {', '.join(POLICIES)}"
            )
        for name in ("timeout_s", "prefetch_timeout_s"):
            if getattr(s, name) <= 0:
                raise ValueError(f"kvtier extra_config key {name!r}: must be above 0")
        return s


class KvtierStorage(HiCacheStorage):
    """SGLang HiCache storage backed by kvtierd (L2 shared memory, then L3)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        self.settings = Settings.parse(getattr(storage_config, "extra_config", None))
        self.mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = (
            writer if writer is not None else (not self.mla or storage_config.tp_rank == 0)
        )
        model = self.settings.model_id or (storage_config.model_name or "")
        if not model:
            raise ValueError(
                "kvtier: no model identity: SGLang passed no model name; set extra_config "
                "key 'model_id'"
            )
        self.model_id = model
        self.namespace = Namespace(tenant=self.settings.namespace)
        self._seed = self.namespace.seed()
        self.client = DaemonClient(self.settings.socket, self.settings.timeout_s)
        self.geometry: pages.PageGeometry | None = None
        self.mem_pool_host = None
        self._session: HostSession | None = None
        self._session_lock = threading.Lock()
        self._retry_at = 0.0
        self._logged: dict[str, float] = {}
        self._stats_lock = threading.Lock()
        self.counters: Counter = Counter()
        self._pending = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # ---- set-up -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host pool's geometry and opens the kvtierd session (or tries later)."""
        super_register = getattr(super(), "register_mem_pool_host", None)
        if super_register is not None:
            super_register(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        self.geometry = pages.PageGeometry.of(mem_pool_host, self.mla)
        if self.geometry.dtype not in DTYPES:
            raise pages.UnsupportedPool(
                f"kvtier: KV dtype {self.geometry.dtype} is not one of {', '.join(DTYPES)}"
            )
        self._live_session()

    def descriptor(self) -> common_pb2.LayoutDescriptor:
        """The kvtier layout of this worker's pages. What SGLang keys by beside the model (the
        pipeline stage, context-parallel shard) goes into the model version, so different
        shards never share a fingerprint."""
        g, c = self.geometry, self.storage_config
        shard = []
        if getattr(c, "pp_size", 1) > 1:
            shard.append(f"pp{c.pp_rank}of{c.pp_size}")
        if getattr(c, "attn_cp_size", 1) > 1:
            shard.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
        if getattr(c, "dcp_size", 1) > 1:
            shard.append(f"dcp{c.dcp_rank}of{c.dcp_size}")
        d = common_pb2.LayoutDescriptor(
            model_id=self.model_id,
            model_version="sglang" + ("/" + "/".join(shard) if shard else ""),
            dtype=DTYPES[g.dtype],
            num_layers=g.layers,
            page_size=g.page_size,
            tp_rank=0 if self.mla else c.tp_rank,
            tp_size=1 if self.mla else c.tp_size,
        )
        if self.mla:
            d.mla.CopyFrom(common_pb2.MlaShape(kv_lora_rank=g.dim_a, rope_dim=g.dim_b))
        else:
            d.mha.CopyFrom(common_pb2.MhaShape(kv_heads=g.dim_a, head_dim=g.dim_b))
        return d

    def _live_session(self) -> HostSession | None:
        """The session, registering one when there is none (at most once per
        reconnect_interval_s while kvtierd cannot be reached)."""
        s = self._session
        if s is not None and not s.closed:
            return s
        if self.geometry is None:
            return None
        with self._session_lock:
            s = self._session
            if s is not None and not s.closed:
                return s
            if time.monotonic() < self._retry_at:
                return None
            c = self.storage_config
            name = f"sglang-tp{c.tp_rank}" + (f"-pp{c.pp_rank}" if c.pp_size > 1 else "")
            try:
                s = HostSession.register(self.client, name, self.descriptor(), self.namespace)
            except KvtierError as e:
                self._retry_at = time.monotonic() + self.settings.reconnect_interval_s
                self._fail("connect", e)
                return None
            if s.page_bytes != self.geometry.page_bytes:
                s.close()
                raise pages.UnsupportedPool(
                    f"kvtierd derived {s.page_bytes}-byte pages from the layout, the host pool "
                    f"has {self.geometry.page_bytes}"
                )
            s.start_heartbeats()
            self._session = s
            self._bump("sessions")
            logger.info(
                "kvtier: session %d on %s (pool %s)",
                s.session_id,
                self.settings.socket,
                s.pool.path,
            )
            return s

    def _drop(self, s: HostSession, e: BaseException) -> None:
        """Gives up a session the daemon no longer serves; the next call registers anew."""
        if isinstance(e, KvtierError) and (e.session_lost or e.retryable):
            with self._session_lock:
                if self._session is s:
                    self._session = None
            s.abandon()

    @contextlib.contextmanager
    def _use(self) -> Iterator[HostSession | None]:
        """The live session, its pool held mapped for the block; None when kvtierd cannot be
        reached."""
        with contextlib.ExitStack() as stack:
            s = self._live_session()
            if s is not None:
                try:
                    stack.enter_context(s.in_use())
                except KvtierError as e:
                    self._drop(s, e)
                    s = None
            yield s

    def _bump(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counters[name] += n

    def _fail(self, reason: str, e: BaseException) -> None:
        self._bump(f"error:{reason}")
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) >= self.settings.log_interval_s:
            self._logged[reason] = now
            logger.warning("kvtier: %s failed (counted as a miss): %s", reason, e)

    # ---- keys ---------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        """A 32-byte kvtier key for an SGLang page key: SGLang's hex digest itself (so SGLang
        and kvtier agents address a page alike), or a digest of it in a tenant namespace."""
        raw = None
        if len(key) == 64:
            try:
                raw = bytes.fromhex(key)
            except ValueError:
                raw = None
        if raw is None:
            raw = hashlib.sha256(b"sglang-key\x00" + key.encode("utf-8")).digest()
        if self._seed is None:
            return raw
        return hashlib.sha256(self._seed + raw).digest()

    def _parent(self, extra_info: Any) -> bytes:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return self._key(prefix[-1]) if prefix else b""

    def _count(self, what: str, n: int, nbytes: int, seconds: float) -> None:
        with self._stats_lock:
            self.counters[f"{what}_pages"] += n
            if n and getattr(self.storage_config, "enable_storage_metrics", False):
                self._pending[f"{what}_pgs"].append(n)
                self._pending[f"{what}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # ---- the zero-copy interface (interface_v1) -------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        if not self.is_writer:
            # MLA: every rank holds the same pages; one rank writes them.
            return [True] * n
        try:
            segs = self._segments(host_indices, n)
            return self._store(segs, [self._key(k) for k in keys], self._parent(extra_info))
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self._fail("set", e)
            return [False] * n

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        try:
            segs = self._segments(host_indices, n)
            got = self._load(segs, [self._key(k) for k in keys], self._parent(extra_info))
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self._fail("get", e)
            return [False] * n
        return [True] * got + [False] * (n - got)

    def _segments(self, host_indices: Any, n: int) -> list[list[pages.Segment]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        segs = self.geometry.segments(ptrs, sizes)
        if len(segs) != n:
            raise pages.UnsupportedPool(f"{len(segs)} host pages for {n} keys")
        return segs

    def _store(
        self, segs: list[list[pages.Segment]], keys: list[bytes], parent: bytes
    ) -> list[bool]:
        """Writes pages into L2 (kvtierd writes them on to L3 per its policy)."""
        n = len(keys)
        with self._use() as s:
            if s is None:
                self._bump("set_unavailable", n)
                return [False] * n
            start = time.perf_counter()
            ok, copied = self._store_in(s, segs, keys, parent)
        self._count(
            "backup", copied, copied * self.geometry.page_bytes, time.perf_counter() - start
        )
        return ok

    def _store_in(
        self, s: HostSession, segs: list[list[pages.Segment]], keys: list[bytes], parent: bytes
    ) -> tuple[list[bool], int]:
        """Reserve, copy, Commit; on any failure the reserved slots are aborted (never left to
        the session's expiry) and the whole batch is False."""
        n = len(keys)
        ok = [False] * n
        reserved: list[bytes] = []
        copied = 0
        try:
            for i, (status, slot) in enumerate(s.reserve(keys, parent)):
                if status == host_pb2.RESERVE_STATUS_PRESENT:
                    ok[i] = True
                elif status == host_pb2.RESERVE_STATUS_RESERVED:
                    base = s.pool.address(slot, 0, self.geometry.page_bytes)
                    reserved.append(keys[i])
                    for seg in segs[i]:
                        pages.store(seg, self.geometry, base)
                    ok[i] = True
                    copied += 1
                else:
                    # No room in L2 now; every later key is refused too.
                    self._bump("set_no_space", n - i)
                    break
            if reserved:
                s.commit(reserved)
                reserved = []
            if copied < sum(ok):
                self._confirm_present(s, keys, ok)
        except Exception as e:
            self._fail("set", e)
            if reserved:
                try:
                    s.abort(reserved)
                except KvtierError:
                    pass
            self._drop(s, e)
            return [False] * n, 0
        return ok, copied

    def _confirm_present(self, s: HostSession, keys: list[bytes], ok: list[bool]) -> None:
        """Keys Reserve called present may still be in another client's hands, not yet
        visible (and that client may give them up). Waits, up to timeout_s, until every key
        this call reports stored is visible in L2 or L3; a key that never shows is False."""
        n = len(keys)
        want = max((i + 1 for i in range(n) if ok[i]), default=0)
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            ready, storage = s.lookup(keys[:want], include_storage=True)
            seen = ready + storage
            if seen >= want:
                return
            if time.monotonic() >= deadline:
                for i in range(seen, n):
                    ok[i] = False
                self._bump("set_not_visible", want - seen)
                return
            time.sleep(0.005)

    def _load(self, segs: list[list[pages.Segment]], keys: list[bytes], parent: bytes) -> int:
        """Copies the longest available prefix of ``keys`` into the host pool: L2 first, then
        what kvtierd loads from L3. Returns how many pages arrived."""
        with self._use() as s:
            if s is None:
                self._bump("get_unavailable", len(keys))
                return 0
            start = time.perf_counter()
            try:
                got = self._copy_out(s, s.acquire(keys), keys, segs, 0)
                if got < len(keys):
                    prev = keys[got - 1] if got else parent
                    got += self._from_storage(s, keys, segs, got, prev)
            except Exception as e:
                self._fail("get", e)
                self._drop(s, e)
                return 0
        self._count("prefetch", got, got * self.geometry.page_bytes, time.perf_counter() - start)
        return got

    def _copy_out(
        self,
        s: HostSession,
        slots: list[int],
        keys: list[bytes],
        segs: list[list[pages.Segment]],
        first: int,
    ) -> int:
        """Copies pinned slots into pages ``first..``, then releases them. A failed Release
        means the pins were dropped while copying: the bytes are void, so nothing counts."""
        if not slots:
            return 0
        try:
            for i, slot in enumerate(slots):
                base = s.pool.address(slot, 0, self.geometry.page_bytes)
                for seg in segs[first + i]:
                    pages.load(seg, self.geometry, base)
        finally:
            # Pins are released even when a copy failed (else they last until the session
            # does).
            s.release(keys[first : first + len(slots)])
        return len(slots)

    def _from_storage(
        self,
        s: HostSession,
        keys: list[bytes],
        segs: list[list[pages.Segment]],
        first: int,
        parent: bytes,
    ) -> int:
        rid = uuid.uuid4().hex
        # SGLang has already decided to load these pages (batch_exists, its own threshold):
        # the daemon's threshold and load-or-recompute test are turned off for the call.
        progress = s.prefetch(
            rid,
            keys[first:],
            parent,
            self.settings.prefetch_policy,
            threshold_tokens=0,
            recompute_tokens_per_second=1,
            timeout=self.settings.prefetch_timeout_s,
        )
        if progress.state == "revoked":
            # Nothing was allocated or pinned, and the prefetch is closed.
            self._bump(f"prefetch_revoked:{progress.reason}")
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
            self._bump(f"prefetch_failed:{progress.reason}")
        return self._copy_out(s, slots, keys, segs, first)

    # ---- lookups ------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading keys kvtierd holds in L2 or L3."""
        if not keys:
            return 0
        with self._use() as s:
            if s is None:
                return 0
            try:
                ready, storage = s.lookup([self._key(k) for k in keys], include_storage=True)
            except Exception as e:  # noqa: BLE001 - never into SGLang's thread
                self._fail("exists", e)
                self._drop(s, e)
                return 0
        return min(ready + storage, len(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the older, tensor-per-page interface ------------------------------------------

    def _flat(self, tensors: list[Any]) -> list[list[pages.Segment]] | None:
        g = self.geometry
        if g is None:
            return None
        out = []
        for t in tensors:
            if t is None or not t.is_contiguous() or t.numel() * t.element_size() != g.page_bytes:
                return None
            out.append(g.flat_segments(t.data_ptr()))
        return out

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Fills each target (a flat data page of the host pool) and returns it; None for the
        pages not found."""
        n = len(keys)
        targets = list(target_locations or [])
        try:
            segs = self._flat(targets) if len(targets) == n else None
            if segs is None:
                self._fail("get", ValueError("targets are not flat host pool pages"))
                return [None] * n
            got = self._load(segs, [self._key(k) for k in keys], b"")
        except Exception as e:  # noqa: BLE001
            self._fail("get", e)
            return [None] * n
        return targets[:got] + [None] * (n - got)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        n = len(keys)
        if n == 0:
            return True
        if not self.is_writer:
            return True
        try:
            segs = (
                self._flat(list(values or [])) if values is not None and len(values) == n else None
            )
            if segs is None:
                self._fail("set", ValueError("values are not flat host pool pages"))
                return False
            return all(self._store(segs, [self._key(k) for k in keys], b""))
        except Exception as e:  # noqa: BLE001
            self._fail("set", e)
            return False

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    # ---- hybrid pools (v2) ----------------------------------------------------------------

    def _v2_unsupported(self) -> None:
        self._fail(
            "v2",
            NotImplementedError(
                "hybrid host pools (batch_*_v2) are not stored in kvtier yet; "
                "every v2 call is a miss"
            ),
        )

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._v2_unsupported()
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        self._v2_unsupported()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        self._v2_unsupported()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # ---- the rest -----------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's "clear the storage". kvtierd's tiers are shared by every worker on the
        node (and their pages stay valid: a key names its content), so one worker does not
        wipe them; an operator clears them with kvtierd's own tools."""
        logger.info("kvtier: clear() leaves kvtierd's shared tiers as they are")

    def get_stats(self) -> Any:
        """Pages and bandwidth per prefetch and backup since the last call, as SGLang's
        storage metrics collector takes them."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # pragma: no cover
            return None
        m = StorageMetrics()
        with self._stats_lock:
            for name, values in self._pending.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def close(self) -> None:
        """Ends the session (SGLang calls this when it detaches the backend)."""
        with self._session_lock:
            s, self._session = self._session, None
        if s is not None:
            s.close()
        self.client.close()
