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

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvtier.host import POLICIES, DaemonClient
from kvtier.identity import (
    CacheIdentity,
    WeightEpoch,
    checkpoint_digest,
    config_digest,
    file_digest,
    longrope_limit,
)
from kvtier.integrations.sglang import pages
from kvtier.keys import Namespace
from kvtier.layout import DTYPES, LayoutSpec, Mha, Mla, State
from kvtier.pool_link import PoolLink, Reporter
from kvtier.settings import fill
from kvtier.v1 import common_pb2

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransfer,
        PoolTransferResult,
    )
    from sglang.srt.mem_cache.pool_host import HostKVCache
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.observability.metrics_collector import StorageMetrics
    from sglang.srt.server_args import ServerArgs

    # The KV pool's host mirror SGLang registers: MHA or MLA.
    KvHost = MHATokenToKVPoolHost | MLATokenToKVPoolHost
else:
    try:  # The base class SGLang checks for; absent only outside an SGLang install.
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError:  # pragma: no cover - exercised only without SGLang
        HiCacheStorage = object

logger = logging.getLogger(__name__)

# SGLang's default prefetch budget (its prefetch_timeout_base, prefetch_timeout_per_ki_token).
SGLANG_PREFETCH_BASE_S = 1.0
SGLANG_PREFETCH_PER_KI_TOKEN_S = 0.25

# Keys of extra_config that belong to SGLang itself, not to this backend.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


@dataclass
class Settings:
    """The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``."""

    # kvtierd's gRPC socket (its `socket`, by default <data_dir>/kvtierd.sock).
    socket: str = "kvtier-data/kvtierd.sock"
    # The model in the cache identity; empty: SGLang's model path (the checkpoint, from its
    # server arguments), or, where SGLang runs without them, the model name it passes.
    model_id: str = ""
    # The KV cache's logical dtype where the host pool stores it as bytes (fp8:
    # "fp8_e4m3", "fp8_e5m2"); empty: SGLang's --kv-cache-dtype. Without either, an fp8
    # pool's pages are this instance's alone.
    kv_cache_dtype: str = ""
    # A tenant name: pages are shared only among instances with the same one.
    namespace: str = ""
    # Deadline of each kvtierd call, in seconds.
    timeout_s: float = 5.0
    # How kvtierd finishes a load from L3: wait_complete or timeout (both end at the load
    # budget below), or best_effort.
    prefetch_policy: str = "wait_complete"
    # The load budget: the longest a load waits for pages from L3, in seconds; 0: SGLang's
    # own prefetch budget, 1 s + 0.25 s per 1024 tokens loaded (SGLang keeps its
    # prefetch_timeout_* keys to itself: mirror a change of them here).
    prefetch_timeout_s: float = 0.0
    # After kvtierd could not be reached, calls are misses for this long before the next try.
    reconnect_interval_s: float = 1.0
    # Least time between two log lines of the same failure.
    log_interval_s: float = 10.0

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> Settings:
        s = Settings()
        fill(s, dict(extra or {}), "extra_config", ignore=SGLANG_KEYS, strict=False)
        if s.prefetch_policy not in POLICIES:
            raise ValueError(
                f"kvtier extra_config key 'prefetch_policy': {s.prefetch_policy!r} is not one "
                f"of {', '.join(POLICIES)}"
            )
        if s.timeout_s <= 0:
            raise ValueError("kvtier extra_config key 'timeout_s': must be above 0")
        if s.prefetch_timeout_s < 0:
            raise ValueError(
                "kvtier extra_config key 'prefetch_timeout_s': must not be negative "
                "(0: SGLang's prefetch budget)"
            )
        return s

    def load_budget_s(self, pages: int, page_tokens: int) -> float:
        """How long a load of ``pages`` pages waits for L3: the setting, or SGLang's own
        prefetch budget for that many tokens."""
        if self.prefetch_timeout_s > 0:
            return self.prefetch_timeout_s
        return SGLANG_PREFETCH_BASE_S + SGLANG_PREFETCH_PER_KI_TOKEN_S * pages * page_tokens / 1024


def _refuse_batch_dependent_rope(sa: object) -> None:
    """Refuses a LongRoPE model served past its original context. SGLang picks the long or
    the short factors for a whole batch, by whether any position in it passes
    ``original_max_position_embeddings`` (its ``Phi3LongRoPEScaledRotaryEmbedding``): a
    page's K then depends on the other requests in its batch, and no page could be shared or
    loaded as recomputed. Within the original context the short factors always apply. The
    model's config is SGLang's own (``get_config``, as it loaded it: download directory,
    revision and override arguments applied); one that cannot be read is refused too, since
    nothing else could tell."""
    path = str(getattr(sa, "model_path", "") or "")
    if not path:
        # SGLang's classes run without its server arguments (tests): the model is a name.
        return
    try:
        config = _sglang_model_config(sa)
    except Exception as e:  # noqa: BLE001 - whatever stops the config from loading
        raise ValueError(
            f"kvtier: cannot read the config of {path} to check how its RoPE is computed "
            f"({e}); kvtier shares pages only of models whose KV depends on the request alone"
        ) from e
    limit = longrope_limit(config)
    if limit is None:
        return
    context = getattr(sa, "context_length", None)
    if limit == 0 or context is None or int(context) > limit:
        raise ValueError(
            f"kvtier: {path} uses LongRoPE, and SGLang picks its long or short factors for a "
            f"whole batch (long once any position passes original_max_position_embeddings = "
            f"{limit or 'unknown'}): a page's K would depend on the other requests in its "
            f"batch, so no page could be shared. Serve it with --context-length {limit or 'N'} "
            f"or less (the short factors then always apply), or without kvtier's backend"
        )


def _sglang_model_config(sa: object) -> dict:
    """The model's config as SGLang loads it, as a dict."""
    try:
        from sglang.srt.utils.hf_transformers.config import get_config
    except ImportError:  # older SGLang
        from sglang.srt.utils.hf_transformers_utils import get_config  # type: ignore[no-redef]
    overrides = str(getattr(sa, "json_model_override_args", "") or "")
    kwargs: dict[str, Any] = {}
    download_dir = getattr(sa, "download_dir", None)
    if download_dir:
        kwargs["cache_dir"] = download_dir
    config = get_config(
        str(getattr(sa, "model_path", "")),
        bool(getattr(sa, "trust_remote_code", False)),
        revision=getattr(sa, "revision", None) or None,
        model_override_args=json.loads(overrides) if overrides else None,
        **kwargs,
    )
    return config.to_dict()


class KvtierStorage(HiCacheStorage):
    """SGLang HiCache storage backed by kvtierd (L2 shared memory, then L3)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, object] | None = None
    ):
        self.storage_config = storage_config
        self.settings = Settings.parse(getattr(storage_config, "extra_config", None))
        self.mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = (
            writer if writer is not None else (not self.mla or storage_config.tp_rank == 0)
        )
        self.server_args = _server_args()
        sa = self.server_args
        model = self.settings.model_id or str(getattr(sa, "model_path", "") or "")
        model = model or (storage_config.model_name or "")
        if not model:
            raise ValueError(
                "kvtier: no model identity: SGLang passed no model name; set extra_config "
                "key 'model_id'"
            )
        self.model_id = model
        _refuse_batch_dependent_rope(sa)
        self.namespace = Namespace(tenant=self.settings.namespace)
        # clear() moves to a new epoch: keys of earlier pages are never asked for again.
        self.epoch = WeightEpoch()
        self._seed = self.namespace.seed()
        self._instance = os.urandom(8).hex()
        # The KV's logical dtype, decided once the host pool is known (kv_dtype).
        self._kv_dtype = ""
        self.client = DaemonClient(self.settings.socket, self.settings.timeout_s)
        self.report = Reporter(self.settings.log_interval_s, logging.getLogger("kvtier.sglang"))
        self.counters = self.report.counters
        self.geometry: pages.PageGeometry | None = None
        # SGLang's host pool (a HostKVCache), once registered.
        self.mem_pool_host: KvHost | None = None
        self._kv: PoolLink | None = None
        # Hybrid pools (v2): name -> (link, host pool), made on first use.
        self._hybrid: dict[str, tuple[PoolLink, HostKVCache]] = {}
        self._hybrid_lock = threading.Lock()
        self._pending = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # ---- set-up -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Takes the host pool's geometry and opens the kvtierd session (or tries later)."""
        super_register = getattr(super(), "register_mem_pool_host", None)
        if super_register is not None:
            super_register(mem_pool_host)
        # The pool SGLang registers here is its KV pool's host mirror, MHA or MLA.
        self.mem_pool_host = cast("KvHost", mem_pool_host)
        g = self.geometry = pages.PageGeometry.of(mem_pool_host, self.mla)
        if g.dtype not in DTYPES:
            raise pages.UnsupportedPool(
                f"kvtier: KV dtype {g.dtype} is not one of {', '.join(DTYPES)}"
            )
        self._kv_dtype = self.kv_dtype()
        self._kv = self._link("kv", self.descriptor(), g.page_bytes)
        self._kv.session()

    def _link(self, label: str, d: common_pb2.LayoutDescriptor, page_bytes: int) -> PoolLink:
        c = self.storage_config
        name = f"sglang-tp{c.tp_rank}" + (f"-pp{c.pp_rank}" if c.pp_size > 1 else "")
        if label != "kv":
            name += f"-{label}"
        return PoolLink(
            label, self.client, d, page_bytes, self.namespace, name, self.report, self.settings
        )

    def kv_dtype(self) -> str:
        """The KV cache's logical dtype: the host pool's, unless the pool stores bytes (fp8),
        then the setting or SGLang's --kv-cache-dtype, else this instance's alone."""
        g = self.geometry
        stored = g.dtype if g is not None else ""
        if stored != "uint8":
            return stored
        named = self.settings.kv_cache_dtype or str(
            getattr(self.server_args, "kv_cache_dtype", "") or ""
        )
        if named and named != "auto":
            return named
        logger.warning(
            "kvtier: the host pool stores its KV as bytes and no KV dtype is known (set "
            "extra_config key 'kv_cache_dtype'); this instance's pages are its own"
        )
        return f"bytes/{self._instance}"

    def identity(self, pool: str = "") -> CacheIdentity:
        """This worker's cache identity (docs/identity.md); ``pool`` names a hybrid pool."""
        c, sa = self.storage_config, self.server_args
        shards = []
        if getattr(c, "attn_cp_size", 1) > 1:
            shards.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
        if getattr(c, "dcp_size", 1) > 1:
            shards.append(f"dcp{c.dcp_rank}of{c.dcp_size}")
        host = self.mem_pool_host
        layers = ""
        if getattr(c, "pp_size", 1) > 1:
            start = getattr(host, "start_layer", None)
            n = getattr(host, "layer_num", None)
            layers = (
                f"{start}-{start + n - 1}"
                if start is not None and n
                else f"pp{c.pp_rank}of{c.pp_size}"
            )
        return CacheIdentity(
            engine="sglang",
            model=self.model_id,
            revision=str(getattr(sa, "revision", "") or ""),
            checkpoint=checkpoint_digest(
                str(getattr(sa, "model_path", "") or ""),
                str(getattr(sa, "revision", "") or ""),
                str(getattr(sa, "download_dir", "") or ""),
            ),
            config=config_digest(
                str(getattr(sa, "quantization", "") or ""),
                str(getattr(sa, "json_model_override_args", "") or ""),
            ),
            weight_version=str(getattr(sa, "weight_version", "") or ""),
            kv_dtype=self._kv_dtype,
            kv_scales=kv_scale_file(sa),
            layers=layers,
            shards="/".join(shards),
            extra=f"pool={pool}" if pool else "",
        )

    def _geometry(self) -> pages.PageGeometry:
        """The registered host pool's geometry (SGLang registers it before any page call)."""
        if self.geometry is None:
            raise pages.UnsupportedPool("kvtier: SGLang has not registered its host pool yet")
        return self.geometry

    def descriptor(self) -> common_pb2.LayoutDescriptor:
        """The kvtier layout of this worker's KV pages."""
        g, c = self._geometry(), self.storage_config
        model_id, version = self.identity().descriptor_fields()
        shape = Mla(g.dim_a, g.dim_b) if self.mla else Mha(g.dim_a, g.dim_b)
        return LayoutSpec(
            model_id=model_id,
            model_version=version,
            dtype=g.dtype,
            num_layers=g.layers,
            page_size=g.page_size,
            shape=shape,
            tp_rank=0 if self.mla else c.tp_rank,
            tp_size=1 if self.mla else c.tp_size,
        ).descriptor()

    def hybrid_descriptor(self, name: str, page_bytes: int) -> common_pb2.LayoutDescriptor:
        """The kvtier layout of a hybrid pool: its flat data pages as bytes. A Mamba state is
        sharded per TP rank even under MLA; other pools are shared as the KV is."""
        c = self.storage_config
        shared = self.mla and name != "mamba"
        model_id, version = self.identity(name).descriptor_fields()
        return LayoutSpec(
            model_id=model_id,
            model_version=version,
            dtype="uint8",
            num_layers=1,
            page_size=1,
            shape=State(page_bytes),
            tp_rank=0 if shared else c.tp_rank,
            tp_size=1 if shared else c.tp_size,
        ).descriptor()

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name: str) -> None:
        """A hybrid pool (SGLang registers each one by name); its session opens on first use."""
        super_register = getattr(super(), "register_mem_host_pool_v2", None)
        if super_register is not None:
            super_register(host_pool, host_pool_name)
        else:  # pragma: no cover - outside SGLang
            self.registered_pools = {
                **getattr(self, "registered_pools", {}),
                host_pool_name: host_pool,
            }
        with self._hybrid_lock:
            self._hybrid.pop(str(host_pool_name), None)

    def _hybrid_pool(self, name: str) -> tuple[PoolLink, HostKVCache]:
        with self._hybrid_lock:
            found = self._hybrid.get(name)
            if found is not None:
                return found
            pools = getattr(self, "registered_pools", {}) or {}
            pool = next((p for n, p in pools.items() if str(n) == name), None)
            if pool is None:
                raise pages.UnsupportedPool(f"no host pool named {name!r} was registered")
            size = pages.FlatPages.page_bytes_of(pool)
            link = self._link(name, self.hybrid_descriptor(name, size), size)
            self._hybrid[name] = (link, pool)
            return link, pool

    # ---- keys ---------------------------------------------------------------------------

    def _keys(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> tuple[list[bytes], bytes]:
        """The kvtier keys of a call's pages and of the page before them, all in the weight
        epoch current when the call began: a ``clear()`` while a backup runs never splits
        its pages between two epochs, and never files pages computed before the clear
        under the epoch after it."""
        seed = self._seed
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        parent = self._key(prefix[-1], seed) if prefix else b""
        return [self._key(k, seed) for k in keys], parent

    @staticmethod
    def _key(key: str, seed: bytes | None) -> bytes:
        """A 32-byte kvtier key for an SGLang page key: SGLang's hex digest itself (so SGLang
        and kvtier agents address a page alike), or a digest of it in a tenant namespace
        (``seed``)."""
        raw = None
        if len(key) == 64:
            try:
                raw = bytes.fromhex(key)
            except ValueError:
                raw = None
        if raw is None:
            raw = hashlib.sha256(b"sglang-key\x00" + key.encode("utf-8")).digest()
        if seed is None:
            return raw
        return hashlib.sha256(seed + raw).digest()

    def _count(self, what: str, n: int, nbytes: int, seconds: float) -> None:
        with self.report.lock:
            self.counters[f"{what}_pages"] += n
            if n and getattr(self.storage_config, "enable_storage_metrics", False):
                self._pending[f"{what}_pgs"].append(n)
                self._pending[f"{what}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # ---- the zero-copy interface (interface_v1) -------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        if not self.is_writer:
            # MLA: every rank holds the same pages; one rank writes them.
            return [True] * n
        try:
            return self._store(self._kv_pages(host_indices, n), *self._keys(keys, extra_info))
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self.report.fail("set", e)
            return [False] * n

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        try:
            got = self._load(self._kv_pages(host_indices, n), *self._keys(keys, extra_info))
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self.report.fail("get", e)
            return [False] * n
        return [True] * got + [False] * (n - got)

    def _kv_pages(self, host_indices: torch.Tensor, n: int) -> pages.KvPages:
        if self.mem_pool_host is None:
            raise pages.UnsupportedPool("kvtier: SGLang has not registered its host pool yet")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        g = self._geometry()
        segs = g.segments(ptrs, sizes)
        if len(segs) != n:
            raise pages.UnsupportedPool(f"{len(segs)} host pages for {n} keys")
        return pages.KvPages(g, segs)

    def _store(self, kv: pages.KvPages, keys: list[bytes], parent: bytes) -> list[bool]:
        if self._kv is None:
            return [False] * len(keys)
        start = time.perf_counter()
        ok, copied = self._kv.store(kv, keys, parent)
        self._count("backup", copied, copied * kv.geometry.page_bytes, time.perf_counter() - start)
        return ok

    def _load(self, kv: pages.KvPages, keys: list[bytes], parent: bytes) -> int:
        if self._kv is None:
            return 0
        start = time.perf_counter()
        got = self._kv.load(kv, keys, parent)
        self._count("prefetch", got, got * kv.geometry.page_bytes, time.perf_counter() - start)
        return got

    # ---- lookups ------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading keys kvtierd holds in L2 or L3."""
        if not keys or self._kv is None:
            return 0
        return self._kv.leading(self._keys(keys)[0])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the older, tensor-per-page interface ------------------------------------------

    def _flat(self, tensors: list[torch.Tensor | None]) -> pages.KvPages | None:
        g = self.geometry
        if g is None:
            return None
        out = []
        for t in tensors:
            if t is None or not t.is_contiguous() or t.numel() * t.element_size() != g.page_bytes:
                return None
            out.append(g.flat_segments(t.data_ptr()))
        return pages.KvPages(g, out)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Fills each target (a flat data page of the host pool) and returns it; None for the
        pages not found."""
        n = len(keys)
        targets = list(target_locations or [])
        try:
            kv = self._flat(targets) if len(targets) == n else None
            if kv is None:
                self.report.fail("get", ValueError("targets are not flat host pool pages"))
                return [None] * n
            got = self._load(kv, self._keys(keys)[0], b"")
        except Exception as e:  # noqa: BLE001
            self.report.fail("get", e)
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
            kv = self._flat(list(values or [])) if values is not None and len(values) == n else None
            if kv is None:
                self.report.fail("set", ValueError("values are not flat host pool pages"))
                return False
            return all(self._store(kv, self._keys(keys)[0], b""))
        except Exception as e:  # noqa: BLE001
            self.report.fail("set", e)
            return False

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    # ---- hybrid pools (v2) ----------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable KV prefix with every hybrid pool's page present as its hit policy asks
        (SGLang's file backend's semantics): ``all_pages`` needs each page of the prefix,
        ``trailing_pages`` only the last ``len(keys)`` pages before the cut, so the prefix
        can end at any length where that window is present."""
        from sglang.srt.mem_cache.hicache_storage import (
            PoolHitPolicy,
            PoolName,
            PoolTransferResult,
        )

        try:
            kkeys = self._keys(keys)[0]
            kv = self._kv.leading(kkeys) if self._kv is not None else 0
            kkeys = kkeys[:kv]
            hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
            restorable = list(range(1, kv + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                name = str(t.name)
                if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    # No verdict: the pool never gates the KV hit, and SGLang heals it from
                    # the KV cut.
                    self.report.bump("v2_block_groups_no_verdict")
                    continue
                link, _ = self._hybrid_pool(name)
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = link.leading(kkeys)
                    allowed = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    window = max(1, len(t.keys) if t.keys else 1)
                    allowed, run = set(), 0
                    for p, here in enumerate(link.present(kkeys), start=1):
                        run = run + 1 if here else 0
                        if run >= min(window, p):
                            allowed.add(p)
                    boundary = max(allowed, default=0)
                else:
                    raise pages.UnsupportedPool(f"hit policy {t.hit_policy!r} of pool {name}")
                if boundary:
                    hits[t.name] = boundary
                restorable = [p for p in restorable if p in allowed]
            final = restorable[-1] if restorable else 0
            return PoolTransferResult(final, hits, restorable)
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self.report.fail("exists_v2", e)
            return PoolTransferResult.empty()

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {t.name: self._v2(t, extra_info, load=True) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {t.name: self._v2(t, extra_info, load=False) for t in transfers}

    def _v2(
        self, t: PoolTransfer, extra_info: HiCacheStorageExtraInfo | None, load: bool
    ) -> list[bool]:
        keys = list(t.keys or [])
        n = len(keys)
        if n == 0:
            return []
        name = str(t.name)
        if name == "kv":
            if t.host_indices is None:
                what = "get" if load else "set"
                self.report.fail(what, pages.UnsupportedPool("a kv transfer without host indices"))
                return [False] * n
            if load:
                return self.batch_get_v1(keys, t.host_indices, extra_info)
            return self.batch_set_v1(keys, t.host_indices, extra_info)
        what = "get_v2" if load else "set_v2"
        try:
            link, pool = self._hybrid_pool(name)
            page_size = int(getattr(pool, "page_size", 1) or 1)
            idx = t.host_indices
            if idx is None or int(idx.numel()) != n * page_size:
                got = 0 if idx is None else int(idx.numel())
                raise pages.UnsupportedPool(
                    f"pool {name}: {got} host indices for {n} keys of {page_size} slots each"
                )
            flat = pages.FlatPages(pool, idx[::page_size].tolist(), link.page_bytes)
            kkeys, parent = self._keys(keys, extra_info)
            if load:
                got = link.load(flat, kkeys, parent)
                self.report.bump(f"v2_get_pages:{name}", got)
                return [True] * got + [False] * (n - got)
            ok, copied = link.store(flat, kkeys, parent)
            self.report.bump(f"v2_set_pages:{name}", copied)
            return ok
        except Exception as e:  # noqa: BLE001 - never into SGLang's thread
            self.report.fail(what, e)
            return [False] * n

    # ---- the rest -----------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's "clear the storage" (``/clear_hicache_storage_backend``, as after a
        weight update): this instance moves to a new weight epoch, so no page stored before
        is found by it again. kvtierd's tiers are shared by every worker on the node, so
        their pages stay for the others (and age out); an operator wipes them with
        ``kvtierctl clear``."""
        self.epoch.bump()
        self._seed = self.epoch.namespace(self.namespace).seed()
        self.report.bump("clears")
        logger.info("kvtier: clear(): a new weight epoch; earlier pages are not used again")

    # SGLang's base method is unannotated (so inferred to return None); its metrics collector
    # takes the StorageMetrics returned here.
    def get_stats(self) -> StorageMetrics | None:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Pages and bandwidth per prefetch and backup since the last call, as SGLang's
        storage metrics collector takes them."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # pragma: no cover
            return None
        m = StorageMetrics()
        with self.report.lock:
            for name, values in self._pending.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def close(self) -> None:
        """Ends the sessions (SGLang calls this when it detaches the backend)."""
        links = [self._kv] if self._kv is not None else []
        with self._hybrid_lock:
            links += [link for link, _ in self._hybrid.values()]
            self._hybrid.clear()
        for link in links:
            link.close()
        self.client.close()


def _server_args() -> ServerArgs | None:
    """SGLang's server arguments in a running server (the checkpoint path, revision, KV
    dtype, weight version); None where SGLang runs without them (its classes driven
    directly, as in tests)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 - absent or unpublished: the backend's settings decide
        return None


def kv_scale_file(server_args: object) -> str:
    """The fp8 KV scales SGLang loads from ``--quantization-param-path``, by content: other
    scales, other K and V bytes for the same tokens."""
    path = str(getattr(server_args, "quantization_param_path", "") or "")
    if not path:
        return ""
    try:
        return f"file:{file_digest(path)}"
    except OSError:
        return f"file-unreadable:{path}"
