from kvtier.v1 import host_pb2 as _host_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
