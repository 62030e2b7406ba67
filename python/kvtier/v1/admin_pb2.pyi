from kvtier.v1 import common_pb2 as _common_pb2
from kvtier.v1 import host_pb2 as _host_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAIN_ACTION_UNSPECIFIED: _ClassVar[DrainAction]
    DRAIN_ACTION_START: _ClassVar[DrainAction]
    DRAIN_ACTION_STATUS: _ClassVar[DrainAction]
    DRAIN_ACTION_CANCEL: _ClassVar[DrainAction]
DRAIN_ACTION_UNSPECIFIED: DrainAction
DRAIN_ACTION_START: DrainAction
DRAIN_ACTION_STATUS: DrainAction
DRAIN_ACTION_CANCEL: DrainAction

class ClearRequest(_message.Message):
    __slots__ = ("tier", "dry_run")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    dry_run: bool
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed", "unwritten", "kept", "rewrite")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    UNWRITTEN_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    REWRITE_FIELD_NUMBER: _ClassVar[int]
    removed: int
    unwritten: int
    kept: int
    rewrite: int
    def __init__(self, removed: _Optional[int] = ..., unwritten: _Optional[int] = ..., kept: _Optional[int] = ..., rewrite: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("done", "pages", "left", "reason")
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    done: bool
    pages: int
    left: int
    reason: str
    def __init__(self, done: _Optional[bool] = ..., pages: _Optional[int] = ..., left: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: DrainAction
    def __init__(self, action: _Optional[_Union[DrainAction, str]] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "safe_to_stop", "unwritten_pages", "queued_writes", "writing_pages", "sessions", "reason")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SAFE_TO_STOP_FIELD_NUMBER: _ClassVar[int]
    UNWRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITING_PAGES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    safe_to_stop: bool
    unwritten_pages: int
    queued_writes: int
    writing_pages: int
    sessions: int
    reason: str
    def __init__(self, draining: _Optional[bool] = ..., safe_to_stop: _Optional[bool] = ..., unwritten_pages: _Optional[int] = ..., queued_writes: _Optional[int] = ..., writing_pages: _Optional[int] = ..., sessions: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class BackendStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendStatusResponse(_message.Message):
    __slots__ = ("attached", "breaker_open", "stats")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPEN_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    breaker_open: bool
    stats: _host_pb2.L3Stats
    def __init__(self, attached: _Optional[bool] = ..., breaker_open: _Optional[bool] = ..., stats: _Optional[_Union[_host_pb2.L3Stats, _Mapping]] = ...) -> None: ...

class AttachBackendRequest(_message.Message):
    __slots__ = ("settings",)
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, settings: _Optional[_Iterable[str]] = ...) -> None: ...

class DetachBackendRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunningConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunningConfigResponse(_message.Message):
    __slots__ = ("toml",)
    TOML_FIELD_NUMBER: _ClassVar[int]
    toml: str
    def __init__(self, toml: _Optional[str] = ...) -> None: ...
