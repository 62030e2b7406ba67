from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FP32: _ClassVar[Dtype]
    DTYPE_FP16: _ClassVar[Dtype]
    DTYPE_BF16: _ClassVar[Dtype]
    DTYPE_FP8_E4M3: _ClassVar[Dtype]
    DTYPE_FP8_E5M2: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_STORAGE: _ClassVar[Tier]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FP32: Dtype
DTYPE_FP16: Dtype
DTYPE_BF16: Dtype
DTYPE_FP8_E4M3: Dtype
DTYPE_FP8_E5M2: Dtype
DTYPE_UINT8: Dtype
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_STORAGE: Tier

class MhaShape(_message.Message):
    __slots__ = ("kv_heads", "head_dim")
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_heads: int
    head_dim: int
    def __init__(self, kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class MlaShape(_message.Message):
    __slots__ = ("kv_lora_rank", "rope_dim")
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_lora_rank: int
    rope_dim: int
    def __init__(self, kv_lora_rank: _Optional[int] = ..., rope_dim: _Optional[int] = ...) -> None: ...

class StateShape(_message.Message):
    __slots__ = ("elems",)
    ELEMS_FIELD_NUMBER: _ClassVar[int]
    elems: int
    def __init__(self, elems: _Optional[int] = ...) -> None: ...

class LayoutDescriptor(_message.Message):
    __slots__ = ("model_id", "model_version", "dtype", "num_layers", "mha", "mla", "state", "page_size", "tp_rank", "tp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MHA_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_version: str
    dtype: Dtype
    num_layers: int
    mha: MhaShape
    mla: MlaShape
    state: StateShape
    page_size: int
    tp_rank: int
    tp_size: int
    def __init__(self, model_id: _Optional[str] = ..., model_version: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., num_layers: _Optional[int] = ..., mha: _Optional[_Union[MhaShape, _Mapping]] = ..., mla: _Optional[_Union[MlaShape, _Mapping]] = ..., state: _Optional[_Union[StateShape, _Mapping]] = ..., page_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LayoutInfo(_message.Message):
    __slots__ = ("fingerprint", "page_bytes", "slot_stride", "run_bytes", "runs_per_page", "format_version")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    RUN_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    page_bytes: int
    slot_stride: int
    run_bytes: int
    runs_per_page: int
    format_version: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., page_bytes: _Optional[int] = ..., slot_stride: _Optional[int] = ..., run_bytes: _Optional[int] = ..., runs_per_page: _Optional[int] = ..., format_version: _Optional[int] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("tenant", "cache_salt", "lora_id", "extra_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    cache_salt: str
    lora_id: str
    extra_key: str
    def __init__(self, tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., extra_key: _Optional[str] = ...) -> None: ...

class PageKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HashSelfTest(_message.Message):
    __slots__ = ("page_size", "namespace", "tokens", "keys")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    namespace: Namespace
    tokens: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, page_size: _Optional[int] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TierHits(_message.Message):
    __slots__ = ("device_pages", "host_pages", "storage_pages")
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    device_pages: int
    host_pages: int
    storage_pages: int
    def __init__(self, device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ..., storage_pages: _Optional[int] = ...) -> None: ...
