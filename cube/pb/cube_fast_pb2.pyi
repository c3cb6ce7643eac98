from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SeekRequest(_message.Message):
    __slots__ = ("keys", "dict_name", "version", "request_id", "table")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DICT_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    dict_name: str
    version: str
    request_id: int
    table: str
    def __init__(self, keys: _Optional[bytes] = ..., dict_name: _Optional[str] = ..., version: _Optional[str] = ..., request_id: _Optional[int] = ..., table: _Optional[str] = ...) -> None: ...

class SeekResponse(_message.Message):
    __slots__ = ("found", "values", "value_width", "offsets", "version", "request_id")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    found: bytes
    values: bytes
    value_width: int
    offsets: bytes
    version: str
    request_id: int
    def __init__(self, found: _Optional[bytes] = ..., values: _Optional[bytes] = ..., value_width: _Optional[int] = ..., offsets: _Optional[bytes] = ..., version: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...
