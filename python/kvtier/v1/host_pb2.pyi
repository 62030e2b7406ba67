from kvtier.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_POLICY_UNSPECIFIED: _ClassVar[PrefetchPolicy]
    PREFETCH_POLICY_BEST_EFFORT: _ClassVar[PrefetchPolicy]
    PREFETCH_POLICY_WAIT_COMPLETE: _ClassVar[PrefetchPolicy]
    PREFETCH_POLICY_TIMEOUT: _ClassVar[PrefetchPolicy]

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATE_UNSPECIFIED: _ClassVar[PrefetchState]
    PREFETCH_STATE_RUNNING: _ClassVar[PrefetchState]
    PREFETCH_STATE_COMPLETED: _ClassVar[PrefetchState]
    PREFETCH_STATE_PARTIAL: _ClassVar[PrefetchState]
    PREFETCH_STATE_TIMED_OUT: _ClassVar[PrefetchState]
    PREFETCH_STATE_REVOKED: _ClassVar[PrefetchState]
    PREFETCH_STATE_FAILED: _ClassVar[PrefetchState]

class MetricKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METRIC_KIND_UNSPECIFIED: _ClassVar[MetricKind]
    METRIC_KIND_COUNTER: _ClassVar[MetricKind]
    METRIC_KIND_GAUGE: _ClassVar[MetricKind]
    METRIC_KIND_HISTOGRAM: _ClassVar[MetricKind]

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_STATUS_UNSPECIFIED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_RESERVED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_PRESENT: _ClassVar[ReserveStatus]
    RESERVE_STATUS_NO_SPACE: _ClassVar[ReserveStatus]

class LandedStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANDED_STATUS_UNSPECIFIED: _ClassVar[LandedStatus]
    LANDED_STATUS_STORED: _ClassVar[LandedStatus]
    LANDED_STATUS_PRESENT: _ClassVar[LandedStatus]
    LANDED_STATUS_NO_ROOM: _ClassVar[LandedStatus]

class PageEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_EVENT_KIND_UNSPECIFIED: _ClassVar[PageEventKind]
    PAGE_EVENT_KIND_STORED: _ClassVar[PageEventKind]
    PAGE_EVENT_KIND_REMOVED: _ClassVar[PageEventKind]
    PAGE_EVENT_KIND_CLEARED: _ClassVar[PageEventKind]
    PAGE_EVENT_KIND_RESYNC: _ClassVar[PageEventKind]

class EventTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TIER_UNSPECIFIED: _ClassVar[EventTier]
    EVENT_TIER_L2_HOST: _ClassVar[EventTier]
    EVENT_TIER_L3_STORAGE: _ClassVar[EventTier]
PREFETCH_POLICY_UNSPECIFIED: PrefetchPolicy
PREFETCH_POLICY_BEST_EFFORT: PrefetchPolicy
PREFETCH_POLICY_WAIT_COMPLETE: PrefetchPolicy
PREFETCH_POLICY_TIMEOUT: PrefetchPolicy
PREFETCH_STATE_UNSPECIFIED: PrefetchState
PREFETCH_STATE_RUNNING: PrefetchState
PREFETCH_STATE_COMPLETED: PrefetchState
PREFETCH_STATE_PARTIAL: PrefetchState
PREFETCH_STATE_TIMED_OUT: PrefetchState
PREFETCH_STATE_REVOKED: PrefetchState
PREFETCH_STATE_FAILED: PrefetchState
METRIC_KIND_UNSPECIFIED: MetricKind
METRIC_KIND_COUNTER: MetricKind
METRIC_KIND_GAUGE: MetricKind
METRIC_KIND_HISTOGRAM: MetricKind
RESERVE_STATUS_UNSPECIFIED: ReserveStatus
RESERVE_STATUS_RESERVED: ReserveStatus
RESERVE_STATUS_PRESENT: ReserveStatus
RESERVE_STATUS_NO_SPACE: ReserveStatus
LANDED_STATUS_UNSPECIFIED: LandedStatus
LANDED_STATUS_STORED: LandedStatus
LANDED_STATUS_PRESENT: LandedStatus
LANDED_STATUS_NO_ROOM: LandedStatus
PAGE_EVENT_KIND_UNSPECIFIED: PageEventKind
PAGE_EVENT_KIND_STORED: PageEventKind
PAGE_EVENT_KIND_REMOVED: PageEventKind
PAGE_EVENT_KIND_CLEARED: PageEventKind
PAGE_EVENT_KIND_RESYNC: PageEventKind
EVENT_TIER_UNSPECIFIED: EventTier
EVENT_TIER_L2_HOST: EventTier
EVENT_TIER_L3_STORAGE: EventTier

class PrefetchHints(_message.Message):
    __slots__ = ("timeout_ms", "threshold_tokens", "recompute_tokens_per_second", "whole_load_pages")
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WHOLE_LOAD_PAGES_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    threshold_tokens: int
    recompute_tokens_per_second: int
    whole_load_pages: int
    def __init__(self, timeout_ms: _Optional[int] = ..., threshold_tokens: _Optional[int] = ..., recompute_tokens_per_second: _Optional[int] = ..., whole_load_pages: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "request_id", "keys", "parent", "policy", "hints", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    request_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    policy: PrefetchPolicy
    hints: PrefetchHints
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., request_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., policy: _Optional[_Union[PrefetchPolicy, str]] = ..., hints: _Optional[_Union[PrefetchHints, _Mapping]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class PrefetchProgress(_message.Message):
    __slots__ = ("request_id", "state", "reason", "policy", "l2_pages", "hit_pages", "landed_pages", "landed_bytes", "elapsed_ms", "deadline_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    LANDED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LANDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: PrefetchState
    reason: str
    policy: PrefetchPolicy
    l2_pages: int
    hit_pages: int
    landed_pages: int
    landed_bytes: int
    elapsed_ms: int
    deadline_ms: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[PrefetchState, str]] = ..., reason: _Optional[str] = ..., policy: _Optional[_Union[PrefetchPolicy, str]] = ..., l2_pages: _Optional[int] = ..., hit_pages: _Optional[int] = ..., landed_pages: _Optional[int] = ..., landed_bytes: _Optional[int] = ..., elapsed_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class PrefetchStatusRequest(_message.Message):
    __slots__ = ("session_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    request_id: str
    def __init__(self, session_id: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class TakePrefetchRequest(_message.Message):
    __slots__ = ("session_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    request_id: str
    def __init__(self, session_id: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class TakePrefetchResponse(_message.Message):
    __slots__ = ("progress", "slots")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    progress: PrefetchProgress
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, progress: _Optional[_Union[PrefetchProgress, _Mapping]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleasePrefetchRequest(_message.Message):
    __slots__ = ("session_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    request_id: str
    def __init__(self, session_id: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleasePrefetchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchMetricsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class MetricLabel(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class HistogramBucket(_message.Message):
    __slots__ = ("upper_bound", "cumulative_count")
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_COUNT_FIELD_NUMBER: _ClassVar[int]
    upper_bound: float
    cumulative_count: int
    def __init__(self, upper_bound: _Optional[float] = ..., cumulative_count: _Optional[int] = ...) -> None: ...

class MetricSample(_message.Message):
    __slots__ = ("name", "labels", "kind", "value", "count", "sum", "buckets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.RepeatedCompositeFieldContainer[MetricLabel]
    kind: MetricKind
    value: float
    count: int
    sum: float
    buckets: _containers.RepeatedCompositeFieldContainer[HistogramBucket]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Iterable[_Union[MetricLabel, _Mapping]]] = ..., kind: _Optional[_Union[MetricKind, str]] = ..., value: _Optional[float] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ..., buckets: _Optional[_Iterable[_Union[HistogramBucket, _Mapping]]] = ...) -> None: ...

class MetricsSnapshot(_message.Message):
    __slots__ = ("seq", "unix_ms", "uptime_ms", "samples")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    unix_ms: int
    uptime_ms: int
    samples: _containers.RepeatedCompositeFieldContainer[MetricSample]
    def __init__(self, seq: _Optional[int] = ..., unix_ms: _Optional[int] = ..., uptime_ms: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[MetricSample, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "layout", "hash_self_test", "expected_layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASH_SELF_TEST_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: _common_pb2.LayoutDescriptor
    hash_self_test: _common_pb2.HashSelfTest
    expected_layout: _common_pb2.LayoutInfo
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.LayoutDescriptor, _Mapping]] = ..., hash_self_test: _Optional[_Union[_common_pb2.HashSelfTest, _Mapping]] = ..., expected_layout: _Optional[_Union[_common_pb2.LayoutInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "ttl_ms", "layout", "pool_path", "pool_slots", "slot_stride", "tenant", "pool_socket")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    ttl_ms: int
    layout: _common_pb2.LayoutInfo
    pool_path: str
    pool_slots: int
    slot_stride: int
    tenant: str
    pool_socket: str
    def __init__(self, session_id: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.LayoutInfo, _Mapping]] = ..., pool_path: _Optional[str] = ..., pool_slots: _Optional[int] = ..., slot_stride: _Optional[int] = ..., tenant: _Optional[str] = ..., pool_socket: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "report")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    report: ClientReport
    def __init__(self, session_id: _Optional[bytes] = ..., report: _Optional[_Union[ClientReport, _Mapping]] = ...) -> None: ...

class ClientReport(_message.Message):
    __slots__ = ("matches", "device_hit_pages", "l2_hit_pages", "l3_hit_pages", "miss_pages", "load_back_pages", "backup_pages", "lost_pages", "evicted_pages", "device_pages", "locked_pages")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    L3_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACK_PAGES_FIELD_NUMBER: _ClassVar[int]
    BACKUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    matches: int
    device_hit_pages: int
    l2_hit_pages: int
    l3_hit_pages: int
    miss_pages: int
    load_back_pages: int
    backup_pages: int
    lost_pages: int
    evicted_pages: int
    device_pages: int
    locked_pages: int
    def __init__(self, matches: _Optional[int] = ..., device_hit_pages: _Optional[int] = ..., l2_hit_pages: _Optional[int] = ..., l3_hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., load_back_pages: _Optional[int] = ..., backup_pages: _Optional[int] = ..., lost_pages: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., device_pages: _Optional[int] = ..., locked_pages: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "keys", "include_storage", "each_key", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STORAGE_FIELD_NUMBER: _ClassVar[int]
    EACH_KEY_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    include_storage: bool
    each_key: bool
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., include_storage: _Optional[bool] = ..., each_key: _Optional[bool] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("ready_pages", "storage_pages", "present")
    READY_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    ready_pages: int
    storage_pages: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ready_pages: _Optional[int] = ..., storage_pages: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "keys", "parent", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("status", "slots")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "keys", "packed_keys", "lease_want")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_WANT_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    lease_want: int
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ..., lease_want: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("leased",)
    LEASED_FIELD_NUMBER: _ClassVar[int]
    leased: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leased: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitLeasedRequest(_message.Message):
    __slots__ = ("session_id", "parent", "packed_keys", "slots", "want")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    parent: bytes
    packed_keys: bytes
    slots: _containers.RepeatedScalarFieldContainer[int]
    want: int
    def __init__(self, session_id: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ..., slots: _Optional[_Iterable[int]] = ..., want: _Optional[int] = ...) -> None: ...

class CommitLeasedResponse(_message.Message):
    __slots__ = ("status", "granted")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[LandedStatus]
    granted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Iterable[_Union[LandedStatus, str]]] = ..., granted: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "keys", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "keys", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "keys", "packed_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("fingerprint", "model_id", "pool_path", "slots", "slot_stride", "ready_pages", "writing_pages", "pinned_pages", "pins", "evictions", "mlocked", "huge_pages")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    READY_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITING_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MLOCKED_FIELD_NUMBER: _ClassVar[int]
    HUGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    model_id: str
    pool_path: str
    slots: int
    slot_stride: int
    ready_pages: int
    writing_pages: int
    pinned_pages: int
    pins: int
    evictions: int
    mlocked: bool
    huge_pages: bool
    def __init__(self, fingerprint: _Optional[bytes] = ..., model_id: _Optional[str] = ..., pool_path: _Optional[str] = ..., slots: _Optional[int] = ..., slot_stride: _Optional[int] = ..., ready_pages: _Optional[int] = ..., writing_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., pins: _Optional[int] = ..., evictions: _Optional[int] = ..., mlocked: _Optional[bool] = ..., huge_pages: _Optional[bool] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_label", "name", "fingerprint", "pins", "writing_pages", "idle_ms", "report", "tenant")
    SESSION_LABEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    WRITING_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_label: str
    name: str
    fingerprint: bytes
    pins: int
    writing_pages: int
    idle_ms: int
    report: ClientReport
    tenant: str
    def __init__(self, session_label: _Optional[str] = ..., name: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., pins: _Optional[int] = ..., writing_pages: _Optional[int] = ..., idle_ms: _Optional[int] = ..., report: _Optional[_Union[ClientReport, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_ms", "pools", "sessions", "reserve_calls", "commit_calls", "acquire_calls", "dedup_pages", "expired_sessions", "metrics_address", "l3", "tenants", "sessions_omitted")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_CALLS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_CALLS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_CALLS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    L3_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_ms: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    reserve_calls: int
    commit_calls: int
    acquire_calls: int
    dedup_pages: int
    expired_sessions: int
    metrics_address: str
    l3: L3Stats
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    sessions_omitted: int
    def __init__(self, version: _Optional[str] = ..., uptime_ms: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., reserve_calls: _Optional[int] = ..., commit_calls: _Optional[int] = ..., acquire_calls: _Optional[int] = ..., dedup_pages: _Optional[int] = ..., expired_sessions: _Optional[int] = ..., metrics_address: _Optional[str] = ..., l3: _Optional[_Union[L3Stats, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., sessions_omitted: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "l2_pages", "l2_quota_pages", "l2_quota_evictions", "l2_quota_refusals", "l3_objects", "l3_bytes", "l3_quota_bytes", "l3_quota_evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_QUOTA_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_QUOTA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    L2_QUOTA_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    L3_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    L3_BYTES_FIELD_NUMBER: _ClassVar[int]
    L3_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    L3_QUOTA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    l2_pages: int
    l2_quota_pages: int
    l2_quota_evictions: int
    l2_quota_refusals: int
    l3_objects: int
    l3_bytes: int
    l3_quota_bytes: int
    l3_quota_evictions: int
    def __init__(self, tenant: _Optional[str] = ..., l2_pages: _Optional[int] = ..., l2_quota_pages: _Optional[int] = ..., l2_quota_evictions: _Optional[int] = ..., l2_quota_refusals: _Optional[int] = ..., l3_objects: _Optional[int] = ..., l3_bytes: _Optional[int] = ..., l3_quota_bytes: _Optional[int] = ..., l3_quota_evictions: _Optional[int] = ...) -> None: ...

class L3Stats(_message.Message):
    __slots__ = ("backend", "write_policy", "objects", "bytes", "capacity_bytes", "written_pages", "skipped_pages", "failed_pages", "deferred_pages", "queued_pages", "evictions")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FAILED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    write_policy: str
    objects: int
    bytes: int
    capacity_bytes: int
    written_pages: int
    skipped_pages: int
    failed_pages: int
    deferred_pages: int
    queued_pages: int
    evictions: int
    def __init__(self, backend: _Optional[str] = ..., write_policy: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., written_pages: _Optional[int] = ..., skipped_pages: _Optional[int] = ..., failed_pages: _Optional[int] = ..., deferred_pages: _Optional[int] = ..., queued_pages: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("stream_id", "after_seq")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    after_seq: int
    def __init__(self, stream_id: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class PageEvent(_message.Message):
    __slots__ = ("seq", "unix_nanos", "kind", "tier", "key", "parent", "layout", "tenant_tag")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENANT_TAG_FIELD_NUMBER: _ClassVar[int]
    seq: int
    unix_nanos: int
    kind: PageEventKind
    tier: EventTier
    key: bytes
    parent: bytes
    layout: str
    tenant_tag: int
    def __init__(self, seq: _Optional[int] = ..., unix_nanos: _Optional[int] = ..., kind: _Optional[_Union[PageEventKind, str]] = ..., tier: _Optional[_Union[EventTier, str]] = ..., key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., layout: _Optional[str] = ..., tenant_tag: _Optional[int] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("stream_id", "node", "events")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    node: str
    events: _containers.RepeatedCompositeFieldContainer[PageEvent]
    def __init__(self, stream_id: _Optional[int] = ..., node: _Optional[str] = ..., events: _Optional[_Iterable[_Union[PageEvent, _Mapping]]] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("layout", "packed_keys", "tokens", "page_size", "namespace", "include_storage")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STORAGE_FIELD_NUMBER: _ClassVar[int]
    layout: str
    packed_keys: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    namespace: _common_pb2.Namespace
    include_storage: bool
    def __init__(self, layout: _Optional[str] = ..., packed_keys: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., include_storage: _Optional[bool] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("l2_pages", "l3_pages", "node")
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    L3_PAGES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    l2_pages: int
    l3_pages: int
    node: str
    def __init__(self, l2_pages: _Optional[int] = ..., l3_pages: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...
