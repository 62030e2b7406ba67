"""A page layout as kvtier's ``LayoutDescriptor`` (proto/kvtier/v1/common.proto) says it:
the one place an integration's layout becomes the message kvtierd and the agent check.

An integration describes its pages with a :class:`LayoutSpec` (the model identity from
:mod:`kvtier.identity`, the dtype, layers, tokens per page, the TP shard and the per-token
shape: :class:`Mha`, :class:`Mla` or :class:`State` for opaque bytes) and sends
``spec.descriptor()``; it never fills the message field by field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.v1 import common_pb2

# The element types a layout may have, by the names engines give them (torch's).
DTYPES = {
    "float32": common_pb2.DTYPE_FP32,
    "float16": common_pb2.DTYPE_FP16,
    "bfloat16": common_pb2.DTYPE_BF16,
    "float8_e4m3fn": common_pb2.DTYPE_FP8_E4M3,
    "float8_e5m2": common_pb2.DTYPE_FP8_E5M2,
    "uint8": common_pb2.DTYPE_UINT8,
}


@dataclass(frozen=True)
class Mha:
    """Multi-head (or grouped-query) attention: K and V per KV head."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention: one compressed KV and the rope part per token."""

    kv_lora_rank: int
    rope_dim: int


@dataclass(frozen=True)
class State:
    """Opaque bytes: ``elems`` elements per token (with ``uint8``, bytes per token)."""

    elems: int


Shape = Mha | Mla | State


@dataclass(frozen=True)
class LayoutSpec:
    """Everything that decides a page's bytes and where they may be shared."""

    model_id: str
    model_version: str
    dtype: str
    num_layers: int
    page_size: int
    shape: Shape
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("num_layers", "page_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} is below 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} is outside 0..{self.tp_size}")

    def descriptor(self) -> common_pb2.LayoutDescriptor:
        """The message kvtierd and the agent register and check."""
        d = common_pb2.LayoutDescriptor(
            model_id=self.model_id,
            model_version=self.model_version,
            dtype=DTYPES[self.dtype],
            num_layers=self.num_layers,
            page_size=self.page_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        s = self.shape
        if isinstance(s, Mha):
            d.mha.CopyFrom(common_pb2.MhaShape(kv_heads=s.kv_heads, head_dim=s.head_dim))
        elif isinstance(s, Mla):
            d.mla.CopyFrom(common_pb2.MlaShape(kv_lora_rank=s.kv_lora_rank, rope_dim=s.rope_dim))
        else:
            d.state.CopyFrom(common_pb2.StateShape(elems=s.elems))
        return d
