from kvtier.v1 import common_pb2 as _common_pb2
from kvtier.v1 import host_pb2 as _host_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CpuPool(_message.Message):
    __slots__ = ("allocation_bytes", "pieces", "memory")
    ALLOCATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    allocation_bytes: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedCompositeFieldContainer[PagePiece]
    memory: bytes
    def __init__(self, allocation_bytes: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[_Union[PagePiece, _Mapping]]] = ..., memory: _Optional[bytes] = ...) -> None: ...

class CudaPool(_message.Message):
    __slots__ = ("device_ordinal", "ipc_handles", "allocation_bytes", "pieces")
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    device_ordinal: int
    ipc_handles: _containers.RepeatedScalarFieldContainer[bytes]
    allocation_bytes: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedCompositeFieldContainer[PagePiece]
    def __init__(self, device_ordinal: _Optional[int] = ..., ipc_handles: _Optional[_Iterable[bytes]] = ..., allocation_bytes: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[_Union[PagePiece, _Mapping]]] = ...) -> None: ...

class PagePiece(_message.Message):
    __slots__ = ("allocation", "offset", "page_stride", "length")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    allocation: int
    offset: int
    page_stride: int
    length: int
    def __init__(self, allocation: _Optional[int] = ..., offset: _Optional[int] = ..., page_stride: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("layout", "num_token_slots", "cpu", "cuda", "engine_cache")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CACHE_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.LayoutDescriptor
    num_token_slots: int
    cpu: CpuPool
    cuda: CudaPool
    engine_cache: bool
    def __init__(self, layout: _Optional[_Union[_common_pb2.LayoutDescriptor, _Mapping]] = ..., num_token_slots: _Optional[int] = ..., cpu: _Optional[_Union[CpuPool, _Mapping]] = ..., cuda: _Optional[_Union[CudaPool, _Mapping]] = ..., engine_cache: _Optional[bool] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("layout", "num_pages", "daemon_connected", "owner")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.LayoutInfo
    num_pages: int
    daemon_connected: bool
    owner: str
    def __init__(self, layout: _Optional[_Union[_common_pb2.LayoutInfo, _Mapping]] = ..., num_pages: _Optional[int] = ..., daemon_connected: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("tokens", "namespace", "packed_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    namespace: _common_pb2.Namespace
    packed_tokens: bytes
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., packed_tokens: _Optional[bytes] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("handle", "device_pages", "l2_pages", "l3_pages", "total_pages")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    L3_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    l2_pages: int
    l3_pages: int
    total_pages: int
    def __init__(self, handle: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., l2_pages: _Optional[int] = ..., l3_pages: _Optional[int] = ..., total_pages: _Optional[int] = ...) -> None: ...

class MatchBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[MatchRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[MatchRequest, _Mapping]]] = ...) -> None: ...

class MatchBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[MatchResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[MatchResponse, _Mapping]]] = ...) -> None: ...

class LoadBackRequest(_message.Message):
    __slots__ = ("handle", "free_pages")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    free_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[int] = ..., free_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadBackResponse(_message.Message):
    __slots__ = ("loaded", "device_pages", "unused_pages")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    UNUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    unused_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, loaded: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., unused_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentPrefetchRequest(_message.Message):
    __slots__ = ("handle", "policy", "hints")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    policy: _host_pb2.PrefetchPolicy
    hints: _host_pb2.PrefetchHints
    def __init__(self, handle: _Optional[int] = ..., policy: _Optional[_Union[_host_pb2.PrefetchPolicy, str]] = ..., hints: _Optional[_Union[_host_pb2.PrefetchHints, _Mapping]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("tokens", "namespace", "device_pages", "packed_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    namespace: _common_pb2.Namespace
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    packed_tokens: bytes
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., device_pages: _Optional[_Iterable[int]] = ..., packed_tokens: _Optional[bytes] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("duplicate_pages", "inserted")
    DUPLICATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    duplicate_pages: _containers.RepeatedScalarFieldContainer[int]
    inserted: int
    def __init__(self, duplicate_pages: _Optional[_Iterable[int]] = ..., inserted: _Optional[int] = ...) -> None: ...

class InsertBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[InsertRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[InsertRequest, _Mapping]]] = ...) -> None: ...

class InsertBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[InsertResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[InsertResponse, _Mapping]]] = ...) -> None: ...

class AgentReleaseRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class ReleaseBatchRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("pages", "backed_up", "lost")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    backed_up: int
    lost: int
    def __init__(self, pages: _Optional[_Iterable[int]] = ..., backed_up: _Optional[int] = ..., lost: _Optional[int] = ...) -> None: ...

class AgentStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatsResponse(_message.Message):
    __slots__ = ("pool_registered", "daemon_connected", "write_policy", "device_pages", "evictable_pages", "locked_pages", "host_only_pages", "open_handles", "backed_up_pages", "lost_pages", "backups_in_flight", "metrics_address", "lost_by_reason", "backup_waits", "backup_wait_seconds", "backups_deferred", "memory_socket")
    POOL_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DAEMON_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_ONLY_PAGES_FIELD_NUMBER: _ClassVar[int]
    OPEN_HANDLES_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOST_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WAITS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOCKET_FIELD_NUMBER: _ClassVar[int]
    pool_registered: bool
    daemon_connected: bool
    write_policy: str
    device_pages: int
    evictable_pages: int
    locked_pages: int
    host_only_pages: int
    open_handles: int
    backed_up_pages: int
    lost_pages: int
    backups_in_flight: int
    metrics_address: str
    lost_by_reason: _containers.RepeatedCompositeFieldContainer[LostPages]
    backup_waits: int
    backup_wait_seconds: float
    backups_deferred: int
    memory_socket: str
    def __init__(self, pool_registered: _Optional[bool] = ..., daemon_connected: _Optional[bool] = ..., write_policy: _Optional[str] = ..., device_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., locked_pages: _Optional[int] = ..., host_only_pages: _Optional[int] = ..., open_handles: _Optional[int] = ..., backed_up_pages: _Optional[int] = ..., lost_pages: _Optional[int] = ..., backups_in_flight: _Optional[int] = ..., metrics_address: _Optional[str] = ..., lost_by_reason: _Optional[_Iterable[_Union[LostPages, _Mapping]]] = ..., backup_waits: _Optional[int] = ..., backup_wait_seconds: _Optional[float] = ..., backups_deferred: _Optional[int] = ..., memory_socket: _Optional[str] = ...) -> None: ...

class LostPages(_message.Message):
    __slots__ = ("reason", "pages")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    reason: str
    pages: int
    def __init__(self, reason: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class PagesLookupRequest(_message.Message):
    __slots__ = ("packed_tokens", "namespace", "start_page", "parent_key", "want_keys")
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_PAGE_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    WANT_KEYS_FIELD_NUMBER: _ClassVar[int]
    packed_tokens: bytes
    namespace: _common_pb2.Namespace
    start_page: int
    parent_key: bytes
    want_keys: bool
    def __init__(self, packed_tokens: _Optional[bytes] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., start_page: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., want_keys: _Optional[bool] = ...) -> None: ...

class PagesLookupResponse(_message.Message):
    __slots__ = ("l2_pages", "l3_pages", "total_pages", "save_pages", "packed_keys")
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    L3_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAVE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    l2_pages: int
    l3_pages: int
    total_pages: int
    save_pages: int
    packed_keys: bytes
    def __init__(self, l2_pages: _Optional[int] = ..., l3_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., save_pages: _Optional[int] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class LoadPagesRequest(_message.Message):
    __slots__ = ("packed_tokens", "namespace", "start_page", "device_pages", "policy", "hints", "parent_key")
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_PAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    packed_tokens: bytes
    namespace: _common_pb2.Namespace
    start_page: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    policy: _host_pb2.PrefetchPolicy
    hints: _host_pb2.PrefetchHints
    parent_key: bytes
    def __init__(self, packed_tokens: _Optional[bytes] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., start_page: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., policy: _Optional[_Union[_host_pb2.PrefetchPolicy, str]] = ..., hints: _Optional[_Union[_host_pb2.PrefetchHints, _Mapping]] = ..., parent_key: _Optional[bytes] = ...) -> None: ...

class LoadPagesResponse(_message.Message):
    __slots__ = ("loaded", "last_key")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LAST_KEY_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    last_key: bytes
    def __init__(self, loaded: _Optional[int] = ..., last_key: _Optional[bytes] = ...) -> None: ...

class SavePagesRequest(_message.Message):
    __slots__ = ("packed_tokens", "namespace", "start_page", "device_pages", "selected", "parent_key")
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_PAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    packed_tokens: bytes
    namespace: _common_pb2.Namespace
    start_page: int
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    selected: int
    parent_key: bytes
    def __init__(self, packed_tokens: _Optional[bytes] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., start_page: _Optional[int] = ..., device_pages: _Optional[_Iterable[int]] = ..., selected: _Optional[int] = ..., parent_key: _Optional[bytes] = ...) -> None: ...

class SaveBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SavePagesRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[SavePagesRequest, _Mapping]]] = ...) -> None: ...

class SaveBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[SavePagesResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[SavePagesResponse, _Mapping]]] = ...) -> None: ...

class SavePagesResponse(_message.Message):
    __slots__ = ("stored", "present", "skipped", "failed")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    skipped: int
    failed: int
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ..., skipped: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("call_ids",)
    CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    call_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, call_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...
