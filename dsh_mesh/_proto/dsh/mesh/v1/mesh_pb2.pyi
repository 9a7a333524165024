import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Delivery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_UNSPECIFIED: _ClassVar[Delivery]
    DELIVERY_STEERED: _ClassVar[Delivery]
    DELIVERY_STARTED_TURN: _ClassVar[Delivery]
    DELIVERY_COLD_RESUMED: _ClassVar[Delivery]

class RejectionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECTION_REASON_UNSPECIFIED: _ClassVar[RejectionReason]
    REJECTION_REASON_SELF_TARGET: _ClassVar[RejectionReason]
    REJECTION_REASON_SIBLING_TARGET: _ClassVar[RejectionReason]
    REJECTION_REASON_ANCESTOR_BEYOND_EDGE: _ClassVar[RejectionReason]
    REJECTION_REASON_DESCENDANT_BEYOND_EDGE: _ClassVar[RejectionReason]
    REJECTION_REASON_UNRELATED_TARGET: _ClassVar[RejectionReason]
    REJECTION_REASON_UNKNOWN_TARGET: _ClassVar[RejectionReason]
    REJECTION_REASON_UNKNOWN_SENDER: _ClassVar[RejectionReason]
    REJECTION_REASON_STALE_SENDER: _ClassVar[RejectionReason]
    REJECTION_REASON_ONE_SHOT_TARGET: _ClassVar[RejectionReason]
    REJECTION_REASON_ONE_SHOT_SENDER: _ClassVar[RejectionReason]
    REJECTION_REASON_PARENT_NOT_LIVE: _ClassVar[RejectionReason]
    REJECTION_REASON_PARENT_REBOUND: _ClassVar[RejectionReason]
    REJECTION_REASON_FORGED_SENDER: _ClassVar[RejectionReason]
    REJECTION_REASON_INVALID_ARGUMENT: _ClassVar[RejectionReason]
    REJECTION_REASON_IDEMPOTENCY_CONFLICT: _ClassVar[RejectionReason]
    REJECTION_REASON_UNAUTHENTICATED: _ClassVar[RejectionReason]
    REJECTION_REASON_REGISTRY_UNAVAILABLE: _ClassVar[RejectionReason]
    REJECTION_REASON_PEER_UNAVAILABLE: _ClassVar[RejectionReason]
    REJECTION_REASON_NODE_FENCED: _ClassVar[RejectionReason]
    REJECTION_REASON_DEADLINE_EXCEEDED: _ClassVar[RejectionReason]
    REJECTION_REASON_UNKNOWN_SESSION: _ClassVar[RejectionReason]
    REJECTION_REASON_TARGET_ELSEWHERE: _ClassVar[RejectionReason]
    REJECTION_REASON_INBOX_FULL: _ClassVar[RejectionReason]
    REJECTION_REASON_NODE_OVERLOADED: _ClassVar[RejectionReason]
    REJECTION_REASON_TOOLS_UNAVAILABLE: _ClassVar[RejectionReason]
    REJECTION_REASON_TREE_LIMIT: _ClassVar[RejectionReason]
    REJECTION_REASON_RATE_LIMITED: _ClassVar[RejectionReason]
    REJECTION_REASON_TREE_CLOSED: _ClassVar[RejectionReason]
    REJECTION_REASON_NAMESPACE_DENIED: _ClassVar[RejectionReason]
    REJECTION_REASON_QUOTA_EXCEEDED: _ClassVar[RejectionReason]
    REJECTION_REASON_APPROVAL_STALE: _ClassVar[RejectionReason]
    REJECTION_REASON_STORE_REFUSED: _ClassVar[RejectionReason]

class ApprovalDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPROVAL_DECISION_UNSPECIFIED: _ClassVar[ApprovalDecision]
    APPROVAL_DECISION_ALLOW: _ClassVar[ApprovalDecision]
    APPROVAL_DECISION_DENY: _ClassVar[ApprovalDecision]
    APPROVAL_DECISION_EDIT: _ClassVar[ApprovalDecision]

class AgentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATE_UNSPECIFIED: _ClassVar[AgentState]
    AGENT_STATE_IDLE: _ClassVar[AgentState]
    AGENT_STATE_RUNNING: _ClassVar[AgentState]
    AGENT_STATE_ABSENT: _ClassVar[AgentState]
    AGENT_STATE_RESIDENT: _ClassVar[AgentState]

class SessionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_KIND_UNSPECIFIED: _ClassVar[SessionKind]
    SESSION_KIND_ROOT: _ClassVar[SessionKind]
    SESSION_KIND_CONTINUABLE_CHILD: _ClassVar[SessionKind]
    SESSION_KIND_ONE_SHOT_CHILD: _ClassVar[SessionKind]

class SettlementOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SETTLEMENT_OUTCOME_UNSPECIFIED: _ClassVar[SettlementOutcome]
    SETTLEMENT_OUTCOME_COMPLETED: _ClassVar[SettlementOutcome]
    SETTLEMENT_OUTCOME_ERROR: _ClassVar[SettlementOutcome]
    SETTLEMENT_OUTCOME_CANCELLED: _ClassVar[SettlementOutcome]
    SETTLEMENT_OUTCOME_TOKEN_EXHAUSTION: _ClassVar[SettlementOutcome]
    SETTLEMENT_OUTCOME_LOST: _ClassVar[SettlementOutcome]

class TurnOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_OUTCOME_UNSPECIFIED: _ClassVar[TurnOutcome]
    TURN_OUTCOME_COMPLETED: _ClassVar[TurnOutcome]
    TURN_OUTCOME_ERROR: _ClassVar[TurnOutcome]
    TURN_OUTCOME_CANCELLED: _ClassVar[TurnOutcome]
    TURN_OUTCOME_TOKEN_EXHAUSTION: _ClassVar[TurnOutcome]
    TURN_OUTCOME_LOST: _ClassVar[TurnOutcome]
    TURN_OUTCOME_AWAITING_APPROVAL: _ClassVar[TurnOutcome]
DELIVERY_UNSPECIFIED: Delivery
DELIVERY_STEERED: Delivery
DELIVERY_STARTED_TURN: Delivery
DELIVERY_COLD_RESUMED: Delivery
REJECTION_REASON_UNSPECIFIED: RejectionReason
REJECTION_REASON_SELF_TARGET: RejectionReason
REJECTION_REASON_SIBLING_TARGET: RejectionReason
REJECTION_REASON_ANCESTOR_BEYOND_EDGE: RejectionReason
REJECTION_REASON_DESCENDANT_BEYOND_EDGE: RejectionReason
REJECTION_REASON_UNRELATED_TARGET: RejectionReason
REJECTION_REASON_UNKNOWN_TARGET: RejectionReason
REJECTION_REASON_UNKNOWN_SENDER: RejectionReason
REJECTION_REASON_STALE_SENDER: RejectionReason
REJECTION_REASON_ONE_SHOT_TARGET: RejectionReason
REJECTION_REASON_ONE_SHOT_SENDER: RejectionReason
REJECTION_REASON_PARENT_NOT_LIVE: RejectionReason
REJECTION_REASON_PARENT_REBOUND: RejectionReason
REJECTION_REASON_FORGED_SENDER: RejectionReason
REJECTION_REASON_INVALID_ARGUMENT: RejectionReason
REJECTION_REASON_IDEMPOTENCY_CONFLICT: RejectionReason
REJECTION_REASON_UNAUTHENTICATED: RejectionReason
REJECTION_REASON_REGISTRY_UNAVAILABLE: RejectionReason
REJECTION_REASON_PEER_UNAVAILABLE: RejectionReason
REJECTION_REASON_NODE_FENCED: RejectionReason
REJECTION_REASON_DEADLINE_EXCEEDED: RejectionReason
REJECTION_REASON_UNKNOWN_SESSION: RejectionReason
REJECTION_REASON_TARGET_ELSEWHERE: RejectionReason
REJECTION_REASON_INBOX_FULL: RejectionReason
REJECTION_REASON_NODE_OVERLOADED: RejectionReason
REJECTION_REASON_TOOLS_UNAVAILABLE: RejectionReason
REJECTION_REASON_TREE_LIMIT: RejectionReason
REJECTION_REASON_RATE_LIMITED: RejectionReason
REJECTION_REASON_TREE_CLOSED: RejectionReason
REJECTION_REASON_NAMESPACE_DENIED: RejectionReason
REJECTION_REASON_QUOTA_EXCEEDED: RejectionReason
REJECTION_REASON_APPROVAL_STALE: RejectionReason
REJECTION_REASON_STORE_REFUSED: RejectionReason
APPROVAL_DECISION_UNSPECIFIED: ApprovalDecision
APPROVAL_DECISION_ALLOW: ApprovalDecision
APPROVAL_DECISION_DENY: ApprovalDecision
APPROVAL_DECISION_EDIT: ApprovalDecision
AGENT_STATE_UNSPECIFIED: AgentState
AGENT_STATE_IDLE: AgentState
AGENT_STATE_RUNNING: AgentState
AGENT_STATE_ABSENT: AgentState
AGENT_STATE_RESIDENT: AgentState
SESSION_KIND_UNSPECIFIED: SessionKind
SESSION_KIND_ROOT: SessionKind
SESSION_KIND_CONTINUABLE_CHILD: SessionKind
SESSION_KIND_ONE_SHOT_CHILD: SessionKind
SETTLEMENT_OUTCOME_UNSPECIFIED: SettlementOutcome
SETTLEMENT_OUTCOME_COMPLETED: SettlementOutcome
SETTLEMENT_OUTCOME_ERROR: SettlementOutcome
SETTLEMENT_OUTCOME_CANCELLED: SettlementOutcome
SETTLEMENT_OUTCOME_TOKEN_EXHAUSTION: SettlementOutcome
SETTLEMENT_OUTCOME_LOST: SettlementOutcome
TURN_OUTCOME_UNSPECIFIED: TurnOutcome
TURN_OUTCOME_COMPLETED: TurnOutcome
TURN_OUTCOME_ERROR: TurnOutcome
TURN_OUTCOME_CANCELLED: TurnOutcome
TURN_OUTCOME_TOKEN_EXHAUSTION: TurnOutcome
TURN_OUTCOME_LOST: TurnOutcome
TURN_OUTCOME_AWAITING_APPROVAL: TurnOutcome

class AgentRef(_message.Message):
    __slots__ = ("session_id", "activation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    activation_id: str
    def __init__(self, session_id: _Optional[str] = ..., activation_id: _Optional[str] = ...) -> None: ...

class SendMessageRequest(_message.Message):
    __slots__ = ("sender", "agent_id", "message", "idempotency_key")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    sender: AgentRef
    agent_id: str
    message: str
    idempotency_key: str
    def __init__(self, sender: _Optional[_Union[AgentRef, _Mapping]] = ..., agent_id: _Optional[str] = ..., message: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SendMessageResponse(_message.Message):
    __slots__ = ("delivery", "accepted_seq", "target_activation_id", "duplicate")
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    delivery: Delivery
    accepted_seq: int
    target_activation_id: str
    duplicate: bool
    def __init__(self, delivery: _Optional[_Union[Delivery, str]] = ..., accepted_seq: _Optional[int] = ..., target_activation_id: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("reason", "detail", "target_session_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TARGET_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    reason: RejectionReason
    detail: str
    target_session_id: str
    def __init__(self, reason: _Optional[_Union[RejectionReason, str]] = ..., detail: _Optional[str] = ..., target_session_id: _Optional[str] = ...) -> None: ...

class ListPricesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPricesResponse(_message.Message):
    __slots__ = ("prices",)
    PRICES_FIELD_NUMBER: _ClassVar[int]
    prices: _containers.RepeatedCompositeFieldContainer[ModelPrice]
    def __init__(self, prices: _Optional[_Iterable[_Union[ModelPrice, _Mapping]]] = ...) -> None: ...

class ModelPrice(_message.Message):
    __slots__ = ("model", "input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_USD_PER_MTOK_FIELD_NUMBER: _ClassVar[int]
    CACHED_INPUT_USD_PER_MTOK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_USD_PER_MTOK_FIELD_NUMBER: _ClassVar[int]
    model: str
    input_usd_per_mtok: float
    cached_input_usd_per_mtok: float
    output_usd_per_mtok: float
    def __init__(self, model: _Optional[str] = ..., input_usd_per_mtok: _Optional[float] = ..., cached_input_usd_per_mtok: _Optional[float] = ..., output_usd_per_mtok: _Optional[float] = ...) -> None: ...

class ListApprovalsRequest(_message.Message):
    __slots__ = ("root_session_id",)
    ROOT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    root_session_id: str
    def __init__(self, root_session_id: _Optional[str] = ...) -> None: ...

class ListApprovalsResponse(_message.Message):
    __slots__ = ("approvals",)
    APPROVALS_FIELD_NUMBER: _ClassVar[int]
    approvals: _containers.RepeatedCompositeFieldContainer[PendingApproval]
    def __init__(self, approvals: _Optional[_Iterable[_Union[PendingApproval, _Mapping]]] = ...) -> None: ...

class PendingApproval(_message.Message):
    __slots__ = ("session_id", "seq", "requested_at", "request")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq: int
    requested_at: _timestamp_pb2.Timestamp
    request: ApprovalRequestEntry
    def __init__(self, session_id: _Optional[str] = ..., seq: _Optional[int] = ..., requested_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., request: _Optional[_Union[ApprovalRequestEntry, _Mapping]] = ...) -> None: ...

class ResolveApprovalRequest(_message.Message):
    __slots__ = ("session_id", "call_id", "decision", "request_digest", "arguments_json", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_id: str
    decision: ApprovalDecision
    request_digest: str
    arguments_json: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., call_id: _Optional[str] = ..., decision: _Optional[_Union[ApprovalDecision, str]] = ..., request_digest: _Optional[str] = ..., arguments_json: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ResolveApprovalResponse(_message.Message):
    __slots__ = ("accepted_seq", "duplicate", "decided_by")
    ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    accepted_seq: int
    duplicate: bool
    decided_by: str
    def __init__(self, accepted_seq: _Optional[int] = ..., duplicate: _Optional[bool] = ..., decided_by: _Optional[str] = ...) -> None: ...

class CreateRootSessionRequest(_message.Message):
    __slots__ = ("preset", "model", "initial_task", "request_id", "node_id", "namespace", "output_schema_json")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INITIAL_TASK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    preset: str
    model: str
    initial_task: str
    request_id: str
    node_id: str
    namespace: str
    output_schema_json: str
    def __init__(self, preset: _Optional[str] = ..., model: _Optional[str] = ..., initial_task: _Optional[str] = ..., request_id: _Optional[str] = ..., node_id: _Optional[str] = ..., namespace: _Optional[str] = ..., output_schema_json: _Optional[str] = ...) -> None: ...

class CreateRootSessionResponse(_message.Message):
    __slots__ = ("session_id", "activation_id", "node_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    activation_id: str
    node_id: str
    def __init__(self, session_id: _Optional[str] = ..., activation_id: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class SubmitPromptRequest(_message.Message):
    __slots__ = ("session_id", "text", "idempotency_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    idempotency_key: str
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SubmitPromptResponse(_message.Message):
    __slots__ = ("accepted_seq", "duplicate")
    ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    accepted_seq: int
    duplicate: bool
    def __init__(self, accepted_seq: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class InterruptRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class InterruptResponse(_message.Message):
    __slots__ = ("interrupted", "turn_id")
    INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    interrupted: bool
    turn_id: str
    def __init__(self, interrupted: _Optional[bool] = ..., turn_id: _Optional[str] = ...) -> None: ...

class StopTreeRequest(_message.Message):
    __slots__ = ("session_id", "close", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    close: bool
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., close: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StopTreeResponse(_message.Message):
    __slots__ = ("session_id", "stop_id", "closed", "turns_cancelled_here")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    TURNS_CANCELLED_HERE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stop_id: str
    closed: bool
    turns_cancelled_here: int
    def __init__(self, session_id: _Optional[str] = ..., stop_id: _Optional[str] = ..., closed: _Optional[bool] = ..., turns_cancelled_here: _Optional[int] = ...) -> None: ...

class ReopenTreeRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReopenTreeResponse(_message.Message):
    __slots__ = ("reopened",)
    REOPENED_FIELD_NUMBER: _ClassVar[int]
    reopened: bool
    def __init__(self, reopened: _Optional[bool] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("header", "activation", "transcript", "next_page_token", "state", "usage")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    header: SessionHeader
    activation: ActivationInfo
    transcript: _containers.RepeatedCompositeFieldContainer[TranscriptEntry]
    next_page_token: str
    state: AgentState
    usage: SessionUsage
    def __init__(self, header: _Optional[_Union[SessionHeader, _Mapping]] = ..., activation: _Optional[_Union[ActivationInfo, _Mapping]] = ..., transcript: _Optional[_Iterable[_Union[TranscriptEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., state: _Optional[_Union[AgentState, str]] = ..., usage: _Optional[_Union[SessionUsage, _Mapping]] = ...) -> None: ...

class SessionUsage(_message.Message):
    __slots__ = ("model_calls", "input_tokens", "output_tokens", "cached_input_tokens", "first_call", "cost_usd", "unpriced_calls")
    MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CALL_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    UNPRICED_CALLS_FIELD_NUMBER: _ClassVar[int]
    model_calls: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    first_call: Usage
    cost_usd: float
    unpriced_calls: int
    def __init__(self, model_calls: _Optional[int] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cached_input_tokens: _Optional[int] = ..., first_call: _Optional[_Union[Usage, _Mapping]] = ..., cost_usd: _Optional[float] = ..., unpriced_calls: _Optional[int] = ...) -> None: ...

class WatchSessionRequest(_message.Message):
    __slots__ = ("session_id", "after_seq", "tree", "after_event_seq", "deltas")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    after_seq: int
    tree: bool
    after_event_seq: int
    deltas: bool
    def __init__(self, session_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., tree: _Optional[bool] = ..., after_event_seq: _Optional[int] = ..., deltas: _Optional[bool] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("entry", "session_id", "event_seq", "activated", "deactivated", "delta")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIVATED_FIELD_NUMBER: _ClassVar[int]
    DEACTIVATED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    entry: TranscriptEntry
    session_id: str
    event_seq: int
    activated: ActivationInfo
    deactivated: ActivationInfo
    delta: TextDelta
    def __init__(self, entry: _Optional[_Union[TranscriptEntry, _Mapping]] = ..., session_id: _Optional[str] = ..., event_seq: _Optional[int] = ..., activated: _Optional[_Union[ActivationInfo, _Mapping]] = ..., deactivated: _Optional[_Union[ActivationInfo, _Mapping]] = ..., delta: _Optional[_Union[TextDelta, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("turn_id", "text", "dropped")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    text: str
    dropped: int
    def __init__(self, turn_id: _Optional[str] = ..., text: _Optional[str] = ..., dropped: _Optional[int] = ...) -> None: ...

class ListAgentsRequest(_message.Message):
    __slots__ = ("root_session_id", "resident_only", "page_size", "page_token", "namespace", "roots_only", "absent_only", "preset", "session_id_prefix", "count", "with_approvals")
    ROOT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ONLY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ROOTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    ABSENT_ONLY_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WITH_APPROVALS_FIELD_NUMBER: _ClassVar[int]
    root_session_id: str
    resident_only: bool
    page_size: int
    page_token: str
    namespace: str
    roots_only: bool
    absent_only: bool
    preset: str
    session_id_prefix: str
    count: bool
    with_approvals: bool
    def __init__(self, root_session_id: _Optional[str] = ..., resident_only: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., namespace: _Optional[str] = ..., roots_only: _Optional[bool] = ..., absent_only: _Optional[bool] = ..., preset: _Optional[str] = ..., session_id_prefix: _Optional[str] = ..., count: _Optional[bool] = ..., with_approvals: _Optional[bool] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("agents", "next_page_token", "total")
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    agents: _containers.RepeatedCompositeFieldContainer[AgentSummary]
    next_page_token: str
    total: int
    def __init__(self, agents: _Optional[_Iterable[_Union[AgentSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class AgentSummary(_message.Message):
    __slots__ = ("header", "activation", "state", "awaiting_approval")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AWAITING_APPROVAL_FIELD_NUMBER: _ClassVar[int]
    header: SessionHeader
    activation: ActivationInfo
    state: AgentState
    awaiting_approval: bool
    def __init__(self, header: _Optional[_Union[SessionHeader, _Mapping]] = ..., activation: _Optional[_Union[ActivationInfo, _Mapping]] = ..., state: _Optional[_Union[AgentState, str]] = ..., awaiting_approval: _Optional[bool] = ...) -> None: ...

class ToolDescriptor(_message.Message):
    __slots__ = ("name", "description", "input_schema_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ...) -> None: ...

class SessionSpec(_message.Message):
    __slots__ = ("preset", "model", "tools", "output_schema_json")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    preset: str
    model: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolDescriptor]
    output_schema_json: str
    def __init__(self, preset: _Optional[str] = ..., model: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolDescriptor, _Mapping]]] = ..., output_schema_json: _Optional[str] = ...) -> None: ...

class ForkOrigin(_message.Message):
    __slots__ = ("parent_session_id", "prefix_seq")
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SEQ_FIELD_NUMBER: _ClassVar[int]
    parent_session_id: str
    prefix_seq: int
    def __init__(self, parent_session_id: _Optional[str] = ..., prefix_seq: _Optional[int] = ...) -> None: ...

class SessionHeader(_message.Message):
    __slots__ = ("session_id", "kind", "parent_session_id", "spec", "fork_origin", "created_at", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    FORK_ORIGIN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: SessionKind
    parent_session_id: str
    spec: SessionSpec
    fork_origin: ForkOrigin
    created_at: _timestamp_pb2.Timestamp
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[_Union[SessionKind, str]] = ..., parent_session_id: _Optional[str] = ..., spec: _Optional[_Union[SessionSpec, _Mapping]] = ..., fork_origin: _Optional[_Union[ForkOrigin, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., namespace: _Optional[str] = ...) -> None: ...

class ActivationInfo(_message.Message):
    __slots__ = ("session_id", "activation_id", "node_id", "parent_activation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    activation_id: str
    node_id: str
    parent_activation_id: str
    def __init__(self, session_id: _Optional[str] = ..., activation_id: _Optional[str] = ..., node_id: _Optional[str] = ..., parent_activation_id: _Optional[str] = ...) -> None: ...

class AgentMessageSource(_message.Message):
    __slots__ = ("kind", "form", "sender_session_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    FORM_FIELD_NUMBER: _ClassVar[int]
    SENDER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    form: str
    sender_session_id: str
    def __init__(self, kind: _Optional[str] = ..., form: _Optional[str] = ..., sender_session_id: _Optional[str] = ...) -> None: ...

class TranscriptEntry(_message.Message):
    __slots__ = ("seq", "recorded_at", "task", "human_prompt", "agent_message", "settlement_notice", "assistant_step", "tool_result", "turn_started", "turn_ended", "consumed", "compaction", "tool_outputs_cleared", "approval_request", "approval_decision", "fork_prefix", "answer_rejected")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    HUMAN_PROMPT_FIELD_NUMBER: _ClassVar[int]
    AGENT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SETTLEMENT_NOTICE_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_STEP_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    TURN_STARTED_FIELD_NUMBER: _ClassVar[int]
    TURN_ENDED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_FIELD_NUMBER: _ClassVar[int]
    TOOL_OUTPUTS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_DECISION_FIELD_NUMBER: _ClassVar[int]
    FORK_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ANSWER_REJECTED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    recorded_at: _timestamp_pb2.Timestamp
    task: TaskEntry
    human_prompt: HumanPromptEntry
    agent_message: AgentMessageEntry
    settlement_notice: SettlementNoticeEntry
    assistant_step: AssistantStepEntry
    tool_result: ToolResultEntry
    turn_started: TurnStartedEntry
    turn_ended: TurnEndedEntry
    consumed: ConsumedEntry
    compaction: CompactionEntry
    tool_outputs_cleared: ToolOutputsClearedEntry
    approval_request: ApprovalRequestEntry
    approval_decision: ApprovalDecisionEntry
    fork_prefix: ForkPrefixEntry
    answer_rejected: AnswerRejectedEntry
    def __init__(self, seq: _Optional[int] = ..., recorded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., task: _Optional[_Union[TaskEntry, _Mapping]] = ..., human_prompt: _Optional[_Union[HumanPromptEntry, _Mapping]] = ..., agent_message: _Optional[_Union[AgentMessageEntry, _Mapping]] = ..., settlement_notice: _Optional[_Union[SettlementNoticeEntry, _Mapping]] = ..., assistant_step: _Optional[_Union[AssistantStepEntry, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResultEntry, _Mapping]] = ..., turn_started: _Optional[_Union[TurnStartedEntry, _Mapping]] = ..., turn_ended: _Optional[_Union[TurnEndedEntry, _Mapping]] = ..., consumed: _Optional[_Union[ConsumedEntry, _Mapping]] = ..., compaction: _Optional[_Union[CompactionEntry, _Mapping]] = ..., tool_outputs_cleared: _Optional[_Union[ToolOutputsClearedEntry, _Mapping]] = ..., approval_request: _Optional[_Union[ApprovalRequestEntry, _Mapping]] = ..., approval_decision: _Optional[_Union[ApprovalDecisionEntry, _Mapping]] = ..., fork_prefix: _Optional[_Union[ForkPrefixEntry, _Mapping]] = ..., answer_rejected: _Optional[_Union[AnswerRejectedEntry, _Mapping]] = ...) -> None: ...

class AnswerRejectedEntry(_message.Message):
    __slots__ = ("reason", "schema_json")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    schema_json: str
    def __init__(self, reason: _Optional[str] = ..., schema_json: _Optional[str] = ...) -> None: ...

class ForkPrefixEntry(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class TaskEntry(_message.Message):
    __slots__ = ("content",)
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    content: str
    def __init__(self, content: _Optional[str] = ...) -> None: ...

class HumanPromptEntry(_message.Message):
    __slots__ = ("content", "idempotency_key")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    content: str
    idempotency_key: str
    def __init__(self, content: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class AgentMessageEntry(_message.Message):
    __slots__ = ("source", "content", "idempotency_key", "delivery", "trace")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    source: AgentMessageSource
    content: str
    idempotency_key: str
    delivery: Delivery
    trace: str
    def __init__(self, source: _Optional[_Union[AgentMessageSource, _Mapping]] = ..., content: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., delivery: _Optional[_Union[Delivery, str]] = ..., trace: _Optional[str] = ...) -> None: ...

class SettlementNoticeEntry(_message.Message):
    __slots__ = ("kind", "child_session_id", "child_activation_id", "outcome", "terminal_output", "detail", "output_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHILD_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    child_session_id: str
    child_activation_id: str
    outcome: SettlementOutcome
    terminal_output: str
    detail: str
    output_json: str
    def __init__(self, kind: _Optional[str] = ..., child_session_id: _Optional[str] = ..., child_activation_id: _Optional[str] = ..., outcome: _Optional[_Union[SettlementOutcome, str]] = ..., terminal_output: _Optional[str] = ..., detail: _Optional[str] = ..., output_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "cached_input_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cached_input_tokens: _Optional[int] = ...) -> None: ...

class AssistantStepEntry(_message.Message):
    __slots__ = ("text", "tool_calls", "usage")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    usage: Usage
    def __init__(self, text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ToolResultEntry(_message.Message):
    __slots__ = ("call_id", "name", "content", "is_error", "duration_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    content: str
    is_error: bool
    duration_ms: int
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., content: _Optional[str] = ..., is_error: _Optional[bool] = ..., duration_ms: _Optional[int] = ...) -> None: ...

class TurnStartedEntry(_message.Message):
    __slots__ = ("turn_id", "node_id", "activation_id", "trace")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    node_id: str
    activation_id: str
    trace: str
    def __init__(self, turn_id: _Optional[str] = ..., node_id: _Optional[str] = ..., activation_id: _Optional[str] = ..., trace: _Optional[str] = ...) -> None: ...

class TurnEndedEntry(_message.Message):
    __slots__ = ("turn_id", "outcome", "detail", "output_json")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    outcome: TurnOutcome
    detail: str
    output_json: str
    def __init__(self, turn_id: _Optional[str] = ..., outcome: _Optional[_Union[TurnOutcome, str]] = ..., detail: _Optional[str] = ..., output_json: _Optional[str] = ...) -> None: ...

class ConsumedEntry(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seqs: _Optional[_Iterable[int]] = ...) -> None: ...

class CompactionEntry(_message.Message):
    __slots__ = ("summary", "from_seq", "through_seq", "task", "pending", "model", "usage")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    THROUGH_SEQ_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    summary: str
    from_seq: int
    through_seq: int
    task: str
    pending: _containers.RepeatedScalarFieldContainer[int]
    model: str
    usage: Usage
    def __init__(self, summary: _Optional[str] = ..., from_seq: _Optional[int] = ..., through_seq: _Optional[int] = ..., task: _Optional[str] = ..., pending: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ApprovalRequestEntry(_message.Message):
    __slots__ = ("call_id", "tool", "arguments_json", "descriptor_digest", "expires_at", "request_digest", "step_seq")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool: str
    arguments_json: str
    descriptor_digest: str
    expires_at: _timestamp_pb2.Timestamp
    request_digest: str
    step_seq: int
    def __init__(self, call_id: _Optional[str] = ..., tool: _Optional[str] = ..., arguments_json: _Optional[str] = ..., descriptor_digest: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., request_digest: _Optional[str] = ..., step_seq: _Optional[int] = ...) -> None: ...

class ApprovalDecisionEntry(_message.Message):
    __slots__ = ("call_id", "decision", "request_digest", "arguments_json", "reason", "by")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    decision: ApprovalDecision
    request_digest: str
    arguments_json: str
    reason: str
    by: str
    def __init__(self, call_id: _Optional[str] = ..., decision: _Optional[_Union[ApprovalDecision, str]] = ..., request_digest: _Optional[str] = ..., arguments_json: _Optional[str] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class ToolOutputsClearedEntry(_message.Message):
    __slots__ = ("seqs",)
    SEQS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seqs: _Optional[_Iterable[int]] = ...) -> None: ...
