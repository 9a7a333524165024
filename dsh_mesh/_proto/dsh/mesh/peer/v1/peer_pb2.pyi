from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("parent_session_id", "child_session_id", "child_activation_id", "child_kind", "outcome", "terminal_output", "detail", "trace")
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_KIND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    parent_session_id: str
    child_session_id: str
    child_activation_id: str
    child_kind: str
    outcome: str
    terminal_output: str
    detail: str
    trace: str
    def __init__(self, parent_session_id: _Optional[str] = ..., child_session_id: _Optional[str] = ..., child_activation_id: _Optional[str] = ..., child_kind: _Optional[str] = ..., outcome: _Optional[str] = ..., terminal_output: _Optional[str] = ..., detail: _Optional[str] = ..., trace: _Optional[str] = ...) -> None: ...

class DeliverNoticeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
