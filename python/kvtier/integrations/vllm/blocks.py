"""Where a vLLM layer's blocks lie in memory, and the order of a block's bytes in a kvtier
page.

vLLM 0.33 views every layer's KV as ``[B, H, N, C]`` over one backing allocation, with the
physical order of those axes (and of the layers) set by its ``KVCacheLayout``; older layouts
put a K/V axis of 2 before the block axis. kvtier stores a page as, for each layer in turn,
the layer's block in its **canonical order**: the block's axes sorted by their strides in
memory (outermost first), so a block that is one span in memory is stored as that span. The
staging path and the agent's DMA path (``pieces``) both move blocks in this order, so a page
stored by one loads bit-identical through the other.

:class:`BlockBytes` is that geometry for one layer: the stride between blocks, where block 0
starts in the layer's storage, and the block's spans (offset, length) in canonical order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.agent import PagePiece


@dataclass(frozen=True)
class BlockBytes:
    """One layer's blocks as bytes of its storage: block ``b`` starts at ``origin + b *
    block_stride``; its canonical bytes are the spans of ``inner`` bytes at every index of
    ``dims`` (size, byte stride), outermost first."""

    num_blocks: int
    block_stride: int
    origin: int
    dims: tuple[tuple[int, int], ...]
    inner: int
    # The canonical order as logical axes of the block (the view's axis index, or "e" for
    # an element's bytes) and their sizes: what a page's bytes mean, whatever vLLM's
    # strides or number of blocks; part of the cache identity.
    form: str

    @property
    def block_bytes(self) -> int:
        return math.prod(size for size, _ in self.dims) * self.inner

    def spans(self) -> list[tuple[int, int]]:
        """The block's (offset from its start, length) spans in canonical order."""
        offsets = [0]
        for size, stride in self.dims:
            offsets = [o + i * stride for o in offsets for i in range(size)]
        return [(o, self.inner) for o in offsets]

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, *dims, inner]`` uint8 view of the layer's ``storage`` (a flat uint8
        tensor over it, :func:`storage_bytes`): indexing block ``b`` gives its canonical
        bytes, and writing into it writes the block."""
        sizes = [self.num_blocks, *(s for s, _ in self.dims), self.inner]
        strides = [self.block_stride, *(st for _, st in self.dims), 1]
        return torch.as_strided(storage, sizes, strides, self.origin)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of ``t``'s storage."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def block_bytes(name: str, t: torch.Tensor, num_blocks: int) -> BlockBytes:
    """The block geometry of vLLM layer ``name``'s KV view ``t``: its block axis is the
    first of size ``num_blocks`` among the first two (a K/V axis of 2 may come first), or
    the first axis holding ``num_blocks`` groups of kernel blocks (vLLM splits a block into
    kernel blocks a constant stride apart)."""
    e = t.element_size()
    shape, strides = list(t.shape), [s * e for s in t.stride()]
    axis = next((d for d in range(min(t.dim(), 2)) if shape[d] == num_blocks), None)
    if axis is None and t.dim() and shape[0] > num_blocks and shape[0] % num_blocks == 0:
        ratio = shape[0] // num_blocks
        shape = [num_blocks, ratio, *shape[1:]]
        strides = [strides[0] * ratio, strides[0], *strides[1:]]
        axis = 0
    if axis is None:
        raise ValueError(
            f"kvtier: KV layer {name!r} of shape {tuple(t.shape)} has no axis of "
            f"{num_blocks} blocks among its first two"
        )
    axes = [
        (str(d), n, s)
        for d, (n, s) in enumerate(zip(shape, strides, strict=True))
        if d != axis and n > 1  # axes of one element do not move anything
    ]
    # Element bytes are the innermost axis.
    axes.append(("e", e, 1))
    axes.sort(key=lambda a: -a[2])
    form = ",".join(f"{a}:{n}" for a, n, _ in axes)
    merged: list[tuple[int, int]] = []
    for _, n, s in reversed(axes):
        if merged and s == merged[-1][0] * merged[-1][1]:
            inner_n, inner_s = merged.pop()
            merged.append((n * inner_n, inner_s))
        else:
            merged.append((n, s))
    merged.reverse()
    inner_n, inner_s = merged.pop()
    if inner_s != 1:
        raise ValueError(f"kvtier: KV layer {name!r}: its elements are not contiguous bytes")
    return BlockBytes(
        num_blocks=num_blocks,
        block_stride=strides[axis],
        origin=int(t.storage_offset()) * e,
        dims=tuple(merged),
        inner=inner_n,
        form=form,
    )


def pieces(layers: list[BlockBytes], bases: list[tuple[int, int]]) -> list[PagePiece]:
    """A page's pieces for the agent: for each layer, its block's spans, placed at
    allocation ``bases[l][0]``, byte ``bases[l][1]`` being where the layer's storage starts
    in that allocation. Spans that continue one another merge."""
    from kvtier.agent import PagePiece  # the gRPC client, only where pieces are registered

    out: list[PagePiece] = []
    for bb, (alloc, base) in zip(layers, bases, strict=True):
        for off, length in bb.spans():
            at = base + bb.origin + off
            last = out[-1] if out else None
            if (
                last is not None
                and last.allocation == alloc
                and last.page_stride == bb.block_stride
                and last.offset + last.length == at
            ):
                out[-1] = PagePiece(alloc, last.offset, last.page_stride, last.length + length)
            else:
                out.append(PagePiece(alloc, at, bb.block_stride, length))
    return out


@dataclass(frozen=True)
class CudaExport:
    """A worker's KV cache as the agent opens it: the GPU, one CUDA IPC handle per backing
    allocation (vLLM 0.33 allocates one for all layers), how many bytes of each the layers
    use from the handle's address, and where each layer's storage starts in them."""

    ordinal: int
    handles: list[bytes]
    allocation_bytes: list[int]
    bases: list[tuple[int, int]]


@dataclass(frozen=True)
class CpuExport:
    """A worker's KV cache in CPU shared memory as the agent maps it: one file per backing
    storage (the descriptor torch keeps for it, deposited at the agent's memory door), how
    many bytes of each the layers use from the file's start, and where each layer's storage
    starts."""

    fds: list[int]
    allocation_bytes: list[int]
    bases: list[tuple[int, int]]


def in_shared_memory(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is a CPU tensor in shared memory (``share_memory_()``)."""
    return bool(tensors) and all(t.device.type == "cpu" and t.is_shared() for t in tensors)


def _mapping_of(address: int) -> tuple[int, int, tuple[int, int], int]:
    """(start address, file offset, device (major, minor), inode) of this process's mapping
    holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                return lo, int(fields[2], 16), (major, minor), int(fields[4])
    raise ValueError(f"no mapping of this process holds address {address:#x}")


def cpu_export(tensors: list[torch.Tensor]) -> CpuExport:
    """Exports the shared-memory storages behind ``tensors`` (CPU tensors after
    ``share_memory_()``, torch's file-descriptor strategy) as the descriptors torch keeps for
    them, once per storage (torch owns them: they stay open as long as the storage). Raises
    ValueError where a tensor is not in shared memory, or its storage is not the file torch
    says it shares."""
    import os

    fds: list[int] = []
    sizes: list[int] = []
    bases: list[tuple[int, int]] = []
    index: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "cpu" or not t.is_shared():
            raise ValueError(f"kvtier: a KV tensor is not in CPU shared memory ({t.device})")
        storage = t.untyped_storage()
        before = storage.data_ptr()
        # (fd, size): the descriptor torch keeps open for the storage's file. Under torch's
        # file_system strategy this moves the storage to new memory, which views taken
        # before (vLLM's) would not follow: refused.
        fd = int(storage._share_fd_cpu_()[0])  # pyright: ignore[reportAttributeAccessIssue]
        if storage.data_ptr() != before:
            raise ValueError(
                "kvtier: sharing the KV cache by descriptor moved it (torch's sharing "
                "strategy is not file_descriptor)"
            )
        start, file_offset, device, inode = _mapping_of(before)
        st = os.fstat(fd)
        if (device, inode) != ((os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino):
            raise ValueError("kvtier: a KV tensor's storage is not the file torch shares it by")
        offset = before - start + file_offset
        a = index.setdefault(fd, len(fds))
        if a == len(fds):
            fds.append(fd)
            sizes.append(0)
        sizes[a] = max(sizes[a], offset + storage.nbytes())
        bases.append((a, offset))
    return CpuExport(fds, sizes, bases)


#: The bytes of a ``cudaIpcMemHandle_t``: what the agent's ``cuIpcOpenMemHandle`` takes.
CUDA_IPC_HANDLE_BYTES = 64


def ipc_mem_handle(shared: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` inside what ``_share_cuda_()`` returns for a storage.

    torch's caching allocator frames it as ``[version][type][payload]``: the version byte
    changes between torch releases (2, then 3) without changing a ``cudaMalloc`` block's
    payload, type ``c`` is such a block followed by its 64-byte handle, and type ``e`` is an
    expandable segment, which has no such handle. Releases before the framing hand over the
    bare 64 bytes. Raises ValueError, naming what it got, for anything else (the worker then
    copies through its staging pool, or refuses ``transfer = "dma"``)."""
    n = CUDA_IPC_HANDLE_BYTES
    if len(shared) == n:
        return shared
    if len(shared) == n + 2 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise ValueError(
            "the KV cache lies in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which has no CUDA IPC handle"
        )
    kind = repr(shared[1:2]) if len(shared) >= 2 else "none"
    raise ValueError(
        f"torch shared the KV cache as {len(shared)} bytes of type {kind}; kvtier reads a "
        f"{n}-byte handle, bare or framed as version, b'c', handle"
    )


def cuda_export(tensors: list[torch.Tensor]) -> CudaExport:
    """Exports the allocations behind ``tensors`` (CUDA tensors) by IPC handle, once per
    allocation. Raises (RuntimeError from torch, ValueError from :func:`ipc_mem_handle`)
    where the allocator's memory cannot be shared that way, e.g. expandable segments."""
    handles: list[bytes] = []
    sizes: list[int] = []
    bases: list[tuple[int, int]] = []
    index: dict[bytes, int] = {}
    for t in tensors:
        if t.device.type != "cuda":
            raise ValueError(f"kvtier: a KV tensor is on {t.device}, not a CUDA GPU")
        # (device, handle, storage bytes, storage's offset in the allocation, ...): what
        # torch.multiprocessing sends another process for the same storage.
        share = t.untyped_storage()._share_cuda_()  # pyright: ignore[reportAttributeAccessIssue]
        handle, size, offset = ipc_mem_handle(bytes(share[1])), int(share[2]), int(share[3])
        a = index.setdefault(handle, len(handles))
        if a == len(handles):
            handles.append(handle)
            sizes.append(0)
        sizes[a] = max(sizes[a], offset + size)
        bases.append((a, offset))
    return CudaExport(tensors[0].device.index or 0, handles, sizes, bases)
