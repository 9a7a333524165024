from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2 as _mesh_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchDeltasRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class WatchDeltasResponse(_message.Message):
    __slots__ = ("delta",)
    DELTA_FIELD_NUMBER: _ClassVar[int]
    delta: _mesh_pb2.TextDelta
    def __init__(self, delta: _Optional[_Union[_mesh_pb2.TextDelta, _Mapping]] = ...) -> None: ...

class ActivateRequest(_message.Message):
    __slots__ = ("session_id", "parent_activation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    parent_activation_id: str
    def __init__(self, session_id: _Optional[str] = ..., parent_activation_id: _Optional[str] = ...) -> None: ...

class ActivateResponse(_message.Message):
    __slots__ = ("activation_id", "parent_activation_id", "node_id")
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    activation_id: str
    parent_activation_id: str
    node_id: str
    def __init__(self, activation_id: _Optional[str] = ..., parent_activation_id: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class DeliverNoticeRequest(_message.Message):
    __slots__ = ("parent_session_id", "child_session_id", "child_activation_id", "child_kind", "outcome", "terminal_output", "detail", "trace", "output_json")
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_KIND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    parent_session_id: str
    child_session_id: str
    child_activation_id: str
    child_kind: str
    outcome: str
    terminal_output: str
    detail: str
    trace: str
    output_json: str
    def __init__(self, parent_session_id: _Optional[str] = ..., child_session_id: _Optional[str] = ..., child_activation_id: _Optional[str] = ..., child_kind: _Optional[str] = ..., outcome: _Optional[str] = ..., terminal_output: _Optional[str] = ..., detail: _Optional[str] = ..., trace: _Optional[str] = ..., output_json: _Optional[str] = ...) -> None: ...

class DeliverNoticeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SendMessagesRequest(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[CarriedMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[CarriedMessage, _Mapping]]] = ...) -> None: ...

class CarriedMessage(_message.Message):
    __slots__ = ("id", "request", "hops", "timeout_ms", "context")
    class ContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: _mesh_pb2.SendMessageRequest
    hops: int
    timeout_ms: int
    context: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[_mesh_pb2.SendMessageRequest, _Mapping]] = ..., hops: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SendMessagesResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[CarriedAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[CarriedAnswer, _Mapping]]] = ...) -> None: ...

class CarriedAnswer(_message.Message):
    __slots__ = ("id", "accepted", "refused")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    id: int
    accepted: _mesh_pb2.SendMessageResponse
    refused: bytes
    def __init__(self, id: _Optional[int] = ..., accepted: _Optional[_Union[_mesh_pb2.SendMessageResponse, _Mapping]] = ..., refused: _Optional[bytes] = ...) -> None: ...
