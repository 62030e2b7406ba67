"""Real SGLang host pools and the kvtier backend, built the way SGLang builds them (for
the SGLang tests and benches; needs SGLang and torch).

The pools are SGLang's own classes (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) over
its own device pools on the CPU (no GPU here: ``device="cpu"``, ``pin_memory=False``); the
backend comes from SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)`` and is
registered with ``register_mem_pool_host`` as SGLang's cache controller does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier.testing.processes import ROOT, Kvtierd  # noqa: F401 - re-exported for the tests

H = TypeVar("H")

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 16
LAYERS = 4


@dataclass
class Worker:
    """One SGLang worker's host pool and its kvtier backend."""

    host: MHATokenToKVPoolHost | MLATokenToKVPoolHost
    backend: HiCacheStorage
    layout: str
    mla: bool

    @property
    def kv(self) -> torch.Tensor:
        """The host pool's buffer."""
        kv = self.host.kv_buffer
        assert kv is not None, "the host pool's buffer was released"
        return kv

    def close(self) -> None:
        """Closes the backend: its agent link and its staging maps."""
        from kvtier.integrations.sglang.backend import KvtierStorage

        assert isinstance(self.backend, KvtierStorage), type(self.backend)
        self.backend.close()

    def indices(self, first_page: int, pages: int) -> torch.Tensor:
        return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)

    def canonical(self, first_page: int) -> torch.Tensor:
        """A page's bytes in kvtier's order (part, layer, token), read through torch views of
        the pool's buffer, independently of kvtier's own copying code."""
        return self._page_view(first_page).contiguous().view(torch.uint8).flatten().clone()

    def put_canonical(self, first_page: int, data: torch.Tensor) -> None:
        """Writes a page given in kvtier's order (the inverse of `canonical`)."""
        view = self._page_view(first_page)
        view.copy_(data.view(view.dtype).reshape(view.shape))

    def _page_view(self, first_page: int) -> torch.Tensor:
        kv, i = self.kv, first_page * PAGE
        if self.mla:  # [L][tok][1][dim] / [tok][L][1][dim] / [page][L][tok][1][dim]
            page = {
                "layer_first": lambda: kv[:, i : i + PAGE],
                "page_first": lambda: kv[i : i + PAGE].transpose(0, 1),
                "page_first_direct": lambda: kv[first_page],
            }[self.layout]()
        else:  # [2][L][tok][H][D] / [2][tok][L][H][D] / [2][page][L][tok][H][D]
            page = {
                "layer_first": lambda: kv[:, :, i : i + PAGE],
                "page_first": lambda: kv[:, i : i + PAGE].transpose(1, 2),
                "page_first_direct": lambda: kv[:, first_page],
            }[self.layout]()
        return page

    def fill(self, first_page: int, pages: int, seed: int) -> list[torch.Tensor]:
        """Random bytes in the pages; their canonical forms."""
        g = torch.Generator().manual_seed(seed)
        flat = self.kv.view(torch.uint8).view(-1)
        for p in range(first_page, first_page + pages):
            for seg_addr, size in zip(*self.host.get_page_buffer_meta(self.indices(p, 1))):
                off = seg_addr - self.kv.data_ptr()
                flat[off : off + size] = torch.randint(
                    0, 256, (size,), generator=g, dtype=torch.uint8
                )
        return [self.canonical(p) for p in range(first_page, first_page + pages)]

    def clear(self) -> None:
        self.kv.zero_()


def worker(
    socket: str,
    layout: str = "layer_first",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "test/model",
    heads: int = 2,
    head_dim: int = 64,
    tokens: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    **settings,
) -> Worker:
    # SGLang's device pool (on the CPU), then its host pool mirroring it, as the engine
    # builds them. MLA: a 32 + 16 latent; MHA: `heads` KV heads of `head_dim`.
    host = _host_pool(layout, mla, heads, head_dim, tokens, dtype)
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.sglang",
        "class_name": "KvtierStorage",
        "interface_v1": 1,
        "socket": socket,
        **settings,
    }
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout != "layer_first",
        model_name=model,
        extra_config=extra,
    )
    # A KvtierStorage, or SGLang's fault injector around one (its test environment variable).
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return Worker(host, backend, layout, mla)


def _host_pool(
    layout: str, mla: bool, heads: int, head_dim: int, tokens: int, dtype: torch.dtype
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """SGLang's device pool (on the CPU), then its host pool mirroring it, as the engine
    builds them. MLA: a 32 + 16 latent; MHA: ``heads`` KV heads of ``head_dim``."""
    if mla:
        dev = MLATokenToKVPool(
            tokens, PAGE, dtype, 32, 16, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
        )
        return _mirror(MLATokenToKVPoolHost, dev, layout, target_layer_num=LAYERS)
    dev = MHATokenToKVPool(
        tokens,
        PAGE,
        dtype,
        heads,
        head_dim,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    return _mirror(MHATokenToKVPoolHost, dev, layout)


def _mirror(
    make: Callable[..., H], dev: MHATokenToKVPool | MLATokenToKVPool, layout: str, **extra: int
) -> H:
    """The host pool ``make`` builds over device pool ``dev``, as SGLang's cache controller
    does."""
    return make(
        dev.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        **extra,
    )


def keys(n: int, salt: str = "") -> list[str]:
    """SGLang-shaped page keys: a chain of hex SHA-256 digests."""
    import hashlib

    out, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
