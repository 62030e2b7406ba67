"""kvtier.layout: a LayoutSpec turns into the descriptor kvtierd checks, for every shape, and
bad fields are refused naming them. (The SGLang and vLLM suites register what it builds with a
real kvtierd and agent.)"""

from __future__ import annotations

import pytest

from kvtier.layout import DTYPES, LayoutSpec, Mha, Mla, State
from kvtier.v1 import common_pb2


def spec(**kw) -> LayoutSpec:
    base = dict(
        model_id="m",
        model_version="v",
        dtype="bfloat16",
        num_layers=4,
        page_size=16,
        shape=Mha(2, 64),
        tp_rank=1,
        tp_size=2,
    )
    base.update(kw)
    return LayoutSpec(**base)


def test_each_shape_fills_its_own_field_and_only_that():
    d = spec().descriptor()
    assert (d.model_id, d.model_version, d.num_layers, d.page_size) == ("m", "v", 4, 16)
    assert (d.dtype, d.tp_rank, d.tp_size) == (common_pb2.DTYPE_BF16, 1, 2)
    assert d.WhichOneof("kind") == "mha" and (d.mha.kv_heads, d.mha.head_dim) == (2, 64)
    d = spec(shape=Mla(512, 64), tp_rank=0, tp_size=1).descriptor()
    assert d.WhichOneof("kind") == "mla" and (d.mla.kv_lora_rank, d.mla.rope_dim) == (512, 64)
    d = spec(dtype="uint8", shape=State(4096)).descriptor()
    assert d.WhichOneof("kind") == "state" and d.state.elems == 4096
    assert d.dtype == common_pb2.DTYPE_UINT8


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "int4"), ("num_layers", 0), ("page_size", 0), ("tp_rank", 2), ("tp_size", 0)],
)
def test_a_bad_field_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        spec(**{field: value})


def test_every_dtype_has_a_wire_value():
    assert len(set(DTYPES.values())) == len(DTYPES)
    for name in DTYPES:
        assert spec(dtype=name).descriptor().dtype == DTYPES[name]
