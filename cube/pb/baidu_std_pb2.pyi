from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RpcMeta(_message.Message):
    __slots__ = ("request", "response", "compress_type", "correlation_id", "attachment_size", "authentication_data")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_TYPE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACHMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATION_DATA_FIELD_NUMBER: _ClassVar[int]
    request: RpcRequestMeta
    response: RpcResponseMeta
    compress_type: int
    correlation_id: int
    attachment_size: int
    authentication_data: bytes
    def __init__(self, request: _Optional[_Union[RpcRequestMeta, _Mapping]] = ..., response: _Optional[_Union[RpcResponseMeta, _Mapping]] = ..., compress_type: _Optional[int] = ..., correlation_id: _Optional[int] = ..., attachment_size: _Optional[int] = ..., authentication_data: _Optional[bytes] = ...) -> None: ...

class RpcRequestMeta(_message.Message):
    __slots__ = ("service_name", "method_name", "log_id")
    SERVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    METHOD_NAME_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    service_name: str
    method_name: str
    log_id: int
    def __init__(self, service_name: _Optional[str] = ..., method_name: _Optional[str] = ..., log_id: _Optional[int] = ...) -> None: ...

class RpcResponseMeta(_message.Message):
    __slots__ = ("error_code", "error_text")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_TEXT_FIELD_NUMBER: _ClassVar[int]
    error_code: int
    error_text: str
    def __init__(self, error_code: _Optional[int] = ..., error_text: _Optional[str] = ...) -> None: ...
