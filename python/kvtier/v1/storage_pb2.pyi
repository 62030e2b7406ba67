from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetObjectRequest(_message.Message):
    __slots__ = ("name", "max_chunk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_chunk: int
    def __init__(self, name: _Optional[str] = ..., max_chunk: _Optional[int] = ...) -> None: ...

class ObjectChunk(_message.Message):
    __slots__ = ("found", "total_len", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    total_len: int
    data: bytes
    def __init__(self, found: _Optional[bool] = ..., total_len: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SetObjectChunk(_message.Message):
    __slots__ = ("name", "total_len", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_len: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., total_len: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SetObjectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("leading",)
    LEADING_FIELD_NUMBER: _ClassVar[int]
    leading: int
    def __init__(self, leading: _Optional[int] = ...) -> None: ...

class DeleteObjectRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteObjectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
