"""How an SGLang host pool's pages map onto kvtier pages.

kvtier stores a page in page-first order: every run (one page of one layer of K, V or the
MLA latent) laid end to end, K's layers first, then V's (kvtier-core ``Layout``). SGLang's
host pools hand out pages as pointers (``get_page_buffer_meta``) whose order depends on the
pool's layout:

* ``layer_first``: one pointer per (layer, part), K and V interleaved per layer: each is one
  run, copied to its run's place;
* ``page_first_direct``: one pointer per part covering all layers, already in kvtier's order;
* ``page_first``: one pointer per part, token-major (``[token][layer][...]``): transposed to
  layer-major on the way in and back on the way out (torch's copy of a transposed view, which
  uses every core; numpy where torch is absent).

So every layout stores the same bytes for the same page, and a page written from one layout
(or by a kvtier-agent) is read back bit-identical by another.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

import numpy as np

from kvtier.pool_link import UnsupportedPool

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class Segment:
    """One pointer's bytes and where they go in the kvtier page."""

    address: int
    size: int
    offset: int
    # Token-major bytes ([tokens][layers][token_bytes]) stored layer-major.
    transposed: bool


@dataclass(frozen=True)
class PageGeometry:
    layout: str
    mla: bool
    layers: int
    page_size: int
    # Bytes of one token of one (layer, part).
    token_bytes: int
    dtype: str
    # MHA: heads and head dim; MLA: kv_lora_rank and rope dim.
    dim_a: int
    dim_b: int

    @property
    def parts(self) -> int:
        return 1 if self.mla else 2

    @property
    def run_bytes(self) -> int:
        return self.token_bytes * self.page_size

    @property
    def part_bytes(self) -> int:
        return self.run_bytes * self.layers

    @property
    def page_bytes(self) -> int:
        return self.part_bytes * self.parts

    @property
    def pointers_per_page(self) -> int:
        return self.parts * (self.layers if self.layout == "layer_first" else 1)

    @staticmethod
    def of(pool: HostKVCache, mla: bool) -> PageGeometry:
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise UnsupportedPool(
                f"host pool layout {layout!r} is not supported; use one of {', '.join(LAYOUTS)}"
            )
        dtype = str(pool.dtype).removeprefix("torch.")
        itemsize = pool.dtype.itemsize
        # SGLang's MLA backend registers its MLA host pool, the others their MHA one.
        if mla:
            p = cast("MLATokenToKVPoolHost", pool)
            a, b = int(p.kv_lora_rank), int(p.qk_rope_head_dim)
            token = (a + b) * itemsize
        else:
            p = cast("MHATokenToKVPoolHost", pool)
            a, b = int(p.head_num), int(p.head_dim)
            v = int(getattr(pool, "v_head_dim", b) or b)
            if v != b:
                raise UnsupportedPool(f"K head dim {b} differs from V head dim {v}")
            token = a * b * itemsize
        return PageGeometry(layout, mla, int(p.layer_num), int(pool.page_size), token, dtype, a, b)

    def segments(self, pointers: Sequence[int], sizes: Sequence[int]) -> list[list[Segment]]:
        """The pages of one ``get_page_buffer_meta`` answer, each as its segments."""
        per = self.pointers_per_page
        if len(pointers) % per or len(sizes) != len(pointers):
            raise UnsupportedPool(
                f"{len(pointers)} pointers for pages of {per} pointers each ({self.layout})"
            )
        want = self.run_bytes if self.layout == "layer_first" else self.part_bytes
        pages = []
        for p in range(0, len(pointers), per):
            segs = []
            for j in range(per):
                if sizes[p + j] != want:
                    raise UnsupportedPool(
                        f"a {self.layout} pointer covers {sizes[p + j]} bytes, expected {want}"
                    )
                if self.layout == "layer_first":
                    layer, part = divmod(j, self.parts)
                    offset = (part * self.layers + layer) * self.run_bytes
                else:
                    offset = j * self.part_bytes
                segs.append(Segment(pointers[p + j], want, offset, self.layout == "page_first"))
            pages.append(segs)
        return pages

    def flat_segments(self, address: int) -> list[Segment]:
        """A page in the pool's flat data-page form (``get_data_page``) at ``address``."""
        if self.layout == "page_first":
            return [
                Segment(address + j * self.part_bytes, self.part_bytes, j * self.part_bytes, True)
                for j in range(self.parts)
            ]
        return [Segment(address, self.page_bytes, 0, False)]


def _bytes_at(address: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


try:  # SGLang always has torch; its copy of a transposed view runs on every core.
    import torch as _torch
except ImportError:  # pragma: no cover - numpy alone, one thread
    _torch = None


def _transpose(dst: int, src: int, size: int, src_shape: tuple, dst_shape: tuple) -> None:
    """Copies ``size`` bytes shaped ``src_shape`` (a, b, c) at ``src`` to ``dst`` as (b, a, c)."""
    s = _bytes_at(src, size).reshape(src_shape)
    d = _bytes_at(dst, size).reshape(dst_shape)
    if _torch is not None:
        _torch.from_numpy(d).copy_(_torch.from_numpy(s).transpose(0, 1))
    else:
        np.copyto(d, s.transpose(1, 0, 2))


def store(seg: Segment, geometry: PageGeometry, slot_address: int) -> None:
    """Copies a segment from the host pool into its place in a slot."""
    dst = slot_address + seg.offset
    if not seg.transposed:
        ctypes.memmove(dst, seg.address, seg.size)
        return
    g = geometry
    _transpose(
        dst,
        seg.address,
        seg.size,
        (g.page_size, g.layers, g.token_bytes),
        (g.layers, g.page_size, g.token_bytes),
    )


def load(seg: Segment, geometry: PageGeometry, slot_address: int) -> None:
    """Copies a segment's bytes from a slot into the host pool."""
    src = slot_address + seg.offset
    if not seg.transposed:
        ctypes.memmove(seg.address, src, seg.size)
        return
    g = geometry
    _transpose(
        seg.address,
        src,
        seg.size,
        (g.layers, g.page_size, g.token_bytes),
        (g.page_size, g.layers, g.token_bytes),
    )


@dataclass(frozen=True)
class KvPages:
    """A call's KV pages as segments of SGLang's pointer lists (zero-copy on SGLang's side)."""

    geometry: PageGeometry
    segs: list[list[Segment]]

    def to_slot(self, i: int, base: int) -> None:
        for seg in self.segs[i]:
            store(seg, self.geometry, base)

    def from_slot(self, i: int, base: int) -> None:
        for seg in self.segs[i]:
            load(seg, self.geometry, base)


class FlatPages:
    """A hybrid pool's pages (a Mamba state, an SWA or indexer cache) as the pool's own flat
    data pages: ``get_data_page(index, flat=True)`` on the way out and
    ``set_from_flat_data_page`` on the way in, the same bytes SGLang's file backend stores.
    Every pool class has these two methods, whatever its internal layout."""

    def __init__(self, pool: HostKVCache, indices: Sequence[int], page_bytes: int):
        self.pool, self.indices, self.page_bytes = pool, list(indices), page_bytes

    @staticmethod
    def page_bytes_of(pool: HostKVCache) -> int:
        page = pool.get_dummy_flat_data_page()
        return int(page.numel()) * int(page.element_size())

    def to_slot(self, i: int, base: int) -> None:
        page = self.pool.get_data_page(self.indices[i], flat=True).contiguous()
        size = int(page.numel()) * int(page.element_size())
        if size != self.page_bytes:
            raise UnsupportedPool(f"a data page has {size} bytes, expected {self.page_bytes}")
        ctypes.memmove(base, page.data_ptr(), size)

    def from_slot(self, i: int, base: int) -> None:
        if _torch is None:  # pragma: no cover - SGLang always has torch
            raise UnsupportedPool("hybrid pools need torch")
        view = _torch.from_numpy(_bytes_at(base, self.page_bytes))
        self.pool.set_from_flat_data_page(self.indices[i], view)
