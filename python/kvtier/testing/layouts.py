"""Layouts the tests share."""

from __future__ import annotations

from kvtier.v1 import common_pb2


def tiny_layout(
    page_size: int, model_id: str = "m", num_layers: int = 2, **fields: object
) -> common_pb2.LayoutDescriptor:
    """A bf16 MHA layout of one KV head of 8 (pages of a few hundred bytes), ``num_layers``
    layers of ``page_size`` tokens; ``fields`` set any other descriptor field."""
    d = common_pb2.LayoutDescriptor(
        model_id=model_id,
        dtype=common_pb2.DTYPE_BF16,
        num_layers=num_layers,
        page_size=page_size,
        tp_rank=0,
        tp_size=1,
    )
    d.mha.CopyFrom(common_pb2.MhaShape(kv_heads=1, head_dim=8))
    for k, v in fields.items():
        setattr(d, k, v)
    return d
