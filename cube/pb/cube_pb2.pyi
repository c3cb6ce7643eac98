from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DictRequest(_message.Message):
    __slots__ = ("keys", "version_required")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSION_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    version_required: bool
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., version_required: _Optional[bool] = ...) -> None: ...

class DictValue(_message.Message):
    __slots__ = ("status", "value")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    status: int
    value: bytes
    def __init__(self, status: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...

class DictResponse(_message.Message):
    __slots__ = ("values", "version")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[DictValue]
    version: str
    def __init__(self, values: _Optional[_Iterable[_Union[DictValue, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("cmd", "version_path", "version")
    CMD_FIELD_NUMBER: _ClassVar[int]
    VERSION_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    cmd: str
    version_path: str
    version: str
    def __init__(self, cmd: _Optional[str] = ..., version_path: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ControlResponse(_message.Message):
    __slots__ = ("cur_version", "bg_version", "status", "message", "detail_json")
    CUR_VERSION_FIELD_NUMBER: _ClassVar[int]
    BG_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    cur_version: str
    bg_version: str
    status: int
    message: str
    detail_json: str
    def __init__(self, cur_version: _Optional[str] = ..., bg_version: _Optional[str] = ..., status: _Optional[int] = ..., message: _Optional[str] = ..., detail_json: _Optional[str] = ...) -> None: ...
