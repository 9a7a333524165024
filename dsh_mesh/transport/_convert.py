"""The one place where wire messages become domain values and back (the transport edge)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from google.protobuf.message import Message

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    MAX_APPROVAL_REASON_CHARS,
    MAX_EDIT_BYTES,
    MAX_EDIT_DEPTH,
    MAX_ID_CHARS,
    MAX_KEY_CHARS,
    MAX_OUTPUT_SCHEMA_BYTES,
    SETTLEMENT_NOTICE_KIND,
    Activation,
    ActivationId,
    AgentMessageEntry,
    AgentRef,
    AnswerRejectedEntry,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    Cost,
    Delivery,
    DeliveryKind,
    ForkPrefixEntry,
    HumanPromptEntry,
    InvalidArgument,
    ModelPrice,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionUsage,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
    check_chars,
    parse_json_field,
    parse_session_id,
)

MAX_NAME_CHARS = 256
"""The most characters a ``CreateRootSession`` ``preset`` or ``model`` may have. Both are
stored in the session header (one etcd value); a longer one is refused as malformed
(``INVALID_ARGUMENT``) rather than failing at etcd's request limit."""
MAX_STOP_REASON_CHARS = 1000
"""The longest ``StopTreeRequest.reason``: it is kept in the registry and in transcripts."""

_ID = MAX_ID_CHARS
_BOUNDS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        message.DESCRIPTOR.full_name: MappingProxyType(fields)
        for message, fields in (
            (
                mesh_pb2.SendMessageRequest,
                {
                    "sender.session_id": _ID,
                    "sender.activation_id": _ID,
                    "agent_id": _ID,
                    "idempotency_key": MAX_KEY_CHARS,
                },
            ),
            (
                mesh_pb2.CreateRootSessionRequest,
                {
                    "preset": MAX_NAME_CHARS,
                    "model": MAX_NAME_CHARS,
                    "request_id": _ID,
                    "node_id": _ID,
                    "namespace": _ID,
                },
            ),
            (mesh_pb2.SubmitPromptRequest, {"session_id": _ID, "idempotency_key": MAX_KEY_CHARS}),
            (mesh_pb2.InterruptRequest, {"session_id": _ID}),
            (mesh_pb2.StopTreeRequest, {"session_id": _ID, "reason": MAX_STOP_REASON_CHARS}),
            (mesh_pb2.ReopenTreeRequest, {"session_id": _ID}),
            (mesh_pb2.GetSessionRequest, {"session_id": _ID, "page_token": _ID}),
            (mesh_pb2.WatchSessionRequest, {"session_id": _ID}),
            (
                mesh_pb2.ListAgentsRequest,
                {
                    "root_session_id": _ID,
                    "page_token": _ID,
                    "namespace": _ID,
                    "preset": _ID,
                    "session_id_prefix": _ID,
                },
            ),
            (
                mesh_pb2.ResolveApprovalRequest,
                {
                    "session_id": _ID,
                    "call_id": _ID,
                    "request_digest": _ID,
                    "reason": MAX_APPROVAL_REASON_CHARS,
                },
            ),
            (mesh_pb2.ListApprovalsRequest, {"root_session_id": _ID}),
        )
    }
)
"""The longest value (in characters) of each id, key, name and reason field of a request a
client (or a node, for ``SendMessage``) sends: ADR 0039, stated per field in mesh.proto.
Content fields (a message, a prompt, a task) are bounded by the node's ``max_message_chars``
where they are accepted."""

_JSON_BOUNDS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        mesh_pb2.ResolveApprovalRequest.DESCRIPTOR.full_name: MappingProxyType(
            {"arguments_json": MAX_EDIT_BYTES}
        ),
        mesh_pb2.CreateRootSessionRequest.DESCRIPTOR.full_name: MappingProxyType(
            {"output_schema_json": MAX_OUTPUT_SCHEMA_BYTES}
        ),
    }
)
"""The JSON fields of a request, with their largest size in UTF-8 bytes; each nests at most
``MAX_EDIT_DEPTH`` deep."""


def bounded_fields(message: type[Message]) -> Mapping[str, int]:
    """The bounded fields of the request ``message`` (dotted paths) and their limits."""
    return _BOUNDS.get(message.DESCRIPTOR.full_name, MappingProxyType({}))


def json_fields(message: type[Message]) -> Mapping[str, int]:
    """The JSON fields of the request ``message`` and their largest size in bytes."""
    return _JSON_BOUNDS.get(message.DESCRIPTOR.full_name, MappingProxyType({}))


def check_bounds(request: Message) -> None:
    """Refuse ``request`` when one of its fields is past its bound (``_BOUNDS``; a JSON field
    also past its size or depth): ``InvalidArgument`` with the metadata ``field`` naming the
    first such field, ``limit`` and ``max``; the detail never quotes the value. A request of a
    kind without bounds passes. Pure; each handler calls it first (after the caller's
    credential), so nothing past a bound is looked up, logged, stored or echoed."""
    name = request.DESCRIPTOR.full_name
    for path, limit in _BOUNDS.get(name, {}).items():
        value: object = request
        for part in path.split("."):
            value = getattr(value, part)
        if isinstance(value, str):  # every path of the table is a string field
            check_chars(path, value, limit)
    for path, max_bytes in _JSON_BOUNDS.get(name, {}).items():
        text = getattr(request, path)
        if text:
            parse_json_field(path, text, max_bytes=max_bytes, max_depth=MAX_EDIT_DEPTH)


_DELIVERY_TO_WIRE = {
    DeliveryKind.STEERED: mesh_pb2.DELIVERY_STEERED,
    DeliveryKind.STARTED_TURN: mesh_pb2.DELIVERY_STARTED_TURN,
    DeliveryKind.COLD_RESUMED: mesh_pb2.DELIVERY_COLD_RESUMED,
}
_DELIVERY_FROM_WIRE = {wire: kind for kind, wire in _DELIVERY_TO_WIRE.items()}


def agent_ref_from_wire(ref: mesh_pb2.AgentRef) -> AgentRef:
    """A validated sender; raises :class:`InvalidArgument` for a malformed one."""
    if not ref.activation_id:
        raise InvalidArgument("sender.activation_id is required")
    return AgentRef(
        session_id=parse_session_id(ref.session_id), activation_id=ActivationId(ref.activation_id)
    )


def agent_ref_to_wire(ref: AgentRef) -> mesh_pb2.AgentRef:
    """The wire form of a sender."""
    return mesh_pb2.AgentRef(session_id=ref.session_id, activation_id=ref.activation_id)


def delivery_to_wire(delivery: Delivery) -> mesh_pb2.SendMessageResponse:
    """A ``SendMessageResponse`` reporting ``delivery``."""
    return mesh_pb2.SendMessageResponse(
        delivery=_DELIVERY_TO_WIRE[delivery.kind],
        accepted_seq=delivery.accepted_seq,
        target_activation_id=delivery.target_activation,
        duplicate=delivery.duplicate,
    )


def delivery_from_wire(target: SessionId, response: mesh_pb2.SendMessageResponse) -> Delivery:
    """The acceptance a ``SendMessageResponse`` reports for ``target``."""
    kind = _DELIVERY_FROM_WIRE.get(response.delivery)
    if kind is None:
        raise InvalidArgument(f"unknown delivery {response.delivery}")
    return Delivery(
        target=target,
        target_activation=ActivationId(response.target_activation_id),
        kind=kind,
        accepted_seq=response.accepted_seq,
        duplicate=response.duplicate,
    )


def notice_to_wire(
    parent: SessionId, notice: SettlementNoticeEntry
) -> peer_pb2.DeliverNoticeRequest:
    """The peer request carrying a settlement notice to the parent's node."""
    return peer_pb2.DeliverNoticeRequest(
        parent_session_id=parent,
        child_session_id=notice.child_session,
        child_activation_id=notice.child_activation,
        child_kind=notice.child_kind.value,
        outcome=notice.outcome.value,
        terminal_output=notice.terminal_output,
        detail=notice.detail,
        trace=notice.trace,
        output_json=notice.output_json,
    )


def notice_from_wire(
    request: peer_pb2.DeliverNoticeRequest,
) -> tuple[SessionId, SettlementNoticeEntry]:
    """The parent and the notice a peer request carries; raises ``InvalidArgument``."""
    try:
        kind = SessionKind(request.child_kind)
        outcome = SettlementOutcome(request.outcome)
    except ValueError as error:
        raise InvalidArgument(f"bad settlement notice: {error}") from error
    if not request.child_activation_id:
        raise InvalidArgument("child_activation_id is required")
    notice = SettlementNoticeEntry(
        child_session=parse_session_id(request.child_session_id),
        child_activation=ActivationId(request.child_activation_id),
        child_kind=kind,
        outcome=outcome,
        terminal_output=request.terminal_output,
        detail=request.detail,
        trace=request.trace,
        output_json=request.output_json,
    )
    return parse_session_id(request.parent_session_id), notice


_KIND_TO_WIRE = {
    SessionKind.ROOT: mesh_pb2.SESSION_KIND_ROOT,
    SessionKind.CONTINUABLE_CHILD: mesh_pb2.SESSION_KIND_CONTINUABLE_CHILD,
    SessionKind.ONE_SHOT_CHILD: mesh_pb2.SESSION_KIND_ONE_SHOT_CHILD,
}
_OUTCOME_TO_WIRE = {
    SettlementOutcome.COMPLETED: mesh_pb2.SETTLEMENT_OUTCOME_COMPLETED,
    SettlementOutcome.ERROR: mesh_pb2.SETTLEMENT_OUTCOME_ERROR,
    SettlementOutcome.CANCELLED: mesh_pb2.SETTLEMENT_OUTCOME_CANCELLED,
    SettlementOutcome.TOKEN_EXHAUSTION: mesh_pb2.SETTLEMENT_OUTCOME_TOKEN_EXHAUSTION,
    SettlementOutcome.LOST: mesh_pb2.SETTLEMENT_OUTCOME_LOST,
}
_TURN_TO_WIRE = {
    TurnOutcome.COMPLETED: mesh_pb2.TURN_OUTCOME_COMPLETED,
    TurnOutcome.ERROR: mesh_pb2.TURN_OUTCOME_ERROR,
    TurnOutcome.CANCELLED: mesh_pb2.TURN_OUTCOME_CANCELLED,
    TurnOutcome.TOKEN_EXHAUSTION: mesh_pb2.TURN_OUTCOME_TOKEN_EXHAUSTION,
    TurnOutcome.LOST: mesh_pb2.TURN_OUTCOME_LOST,
    TurnOutcome.AWAITING_APPROVAL: mesh_pb2.TURN_OUTCOME_AWAITING_APPROVAL,
}
DECISION_TO_WIRE = {
    ApprovalDecision.ALLOW: mesh_pb2.APPROVAL_DECISION_ALLOW,
    ApprovalDecision.DENY: mesh_pb2.APPROVAL_DECISION_DENY,
    ApprovalDecision.EDIT: mesh_pb2.APPROVAL_DECISION_EDIT,
}
DECISION_FROM_WIRE = {wire: decision for decision, wire in DECISION_TO_WIRE.items()}


def header_to_wire(header: SessionHeader) -> mesh_pb2.SessionHeader:
    """The wire form of a session header."""
    wire = mesh_pb2.SessionHeader(
        session_id=header.session_id,
        kind=_KIND_TO_WIRE[header.kind],
        parent_session_id=header.parent_session or "",
        namespace=header.namespace,
        spec=mesh_pb2.SessionSpec(
            preset=header.spec.preset,
            model=header.spec.model,
            tools=[
                mesh_pb2.ToolDescriptor(
                    name=t.name, description=t.description, input_schema_json=t.input_schema_json
                )
                for t in header.spec.tools
            ],
            output_schema_json=header.spec.output_schema,
        ),
    )
    if header.created_at is not None:
        wire.created_at.FromDatetime(header.created_at)
    if header.fork_origin is not None:
        wire.fork_origin.CopyFrom(
            mesh_pb2.ForkOrigin(
                parent_session_id=header.fork_origin.parent_session,
                prefix_seq=header.fork_origin.prefix_seq,
            )
        )
    return wire


def activation_to_wire(activation: Activation) -> mesh_pb2.ActivationInfo:
    """The wire form of an activation."""
    return mesh_pb2.ActivationInfo(
        session_id=activation.session_id,
        activation_id=activation.activation_id,
        node_id=activation.node_id,
        parent_activation_id=activation.parent_activation or "",
    )


def record_to_wire(record: Record) -> mesh_pb2.TranscriptEntry:
    """The wire form of one transcript record, with its ``recorded_at`` when it has one."""
    entry = record.entry
    wire = mesh_pb2.TranscriptEntry(seq=record.seq)
    if record.recorded_at is not None:
        wire.recorded_at.FromDatetime(record.recorded_at)
    if isinstance(entry, TaskEntry):
        wire.task.content = entry.content
    elif isinstance(entry, HumanPromptEntry):
        wire.human_prompt.content = entry.content
        wire.human_prompt.idempotency_key = entry.idempotency_key
    elif isinstance(entry, AgentMessageEntry):
        wire.agent_message.source.kind = entry.source.kind
        wire.agent_message.source.form = entry.source.form
        wire.agent_message.source.sender_session_id = entry.source.sender_session_id
        wire.agent_message.content = entry.content
        wire.agent_message.trace = entry.trace
        wire.agent_message.idempotency_key = entry.idempotency_key
        delivery = getattr(entry, "delivery", None)
        if delivery is not None:
            wire.agent_message.delivery = _DELIVERY_TO_WIRE[delivery]
    elif isinstance(entry, SettlementNoticeEntry):
        notice = wire.settlement_notice
        notice.kind = SETTLEMENT_NOTICE_KIND
        notice.child_session_id = entry.child_session
        notice.child_activation_id = entry.child_activation
        notice.outcome = _OUTCOME_TO_WIRE[entry.outcome]
        notice.terminal_output = entry.terminal_output
        notice.detail = entry.detail
        notice.output_json = entry.output_json
    elif isinstance(entry, AssistantStepEntry):
        step = wire.assistant_step
        step.text = entry.text
        step.tool_calls.extend(
            mesh_pb2.ToolCall(id=c.call_id, name=c.name, arguments_json=c.arguments_json)
            for c in entry.tool_calls
        )
        step.usage.CopyFrom(usage_to_wire(entry.usage))
    elif isinstance(entry, ToolResultEntry):
        wire.tool_result.call_id = entry.call_id
        wire.tool_result.name = entry.name
        wire.tool_result.content = entry.content
        wire.tool_result.is_error = entry.is_error
        wire.tool_result.duration_ms = entry.duration_ms
    elif isinstance(entry, TurnStartedEntry):
        wire.turn_started.turn_id = entry.turn_id
        wire.turn_started.node_id = entry.node_id
        wire.turn_started.activation_id = entry.activation_id
        wire.turn_started.trace = entry.trace
    elif isinstance(entry, TurnEndedEntry):
        wire.turn_ended.turn_id = entry.turn_id
        wire.turn_ended.outcome = _TURN_TO_WIRE[entry.outcome]
        wire.turn_ended.detail = entry.detail
        wire.turn_ended.output_json = entry.output_json
    elif isinstance(entry, AnswerRejectedEntry):
        wire.answer_rejected.reason = entry.reason
        wire.answer_rejected.schema_json = entry.schema
    elif isinstance(entry, ConsumedEntry):
        wire.consumed.seqs.extend(entry.seqs)
    elif isinstance(entry, CompactionEntry):
        compaction = wire.compaction
        compaction.summary = entry.summary
        compaction.from_seq = entry.from_seq
        compaction.through_seq = entry.through_seq
        compaction.task = entry.task
        compaction.pending.extend(entry.pending)
        compaction.model = entry.model
        compaction.usage.CopyFrom(usage_to_wire(entry.usage))
    elif isinstance(entry, ToolOutputsClearedEntry):
        wire.tool_outputs_cleared.seqs.extend(entry.seqs)
    elif isinstance(entry, ApprovalRequestEntry):
        request = wire.approval_request
        request.call_id = entry.call_id
        request.step_seq = entry.step_seq
        request.tool = entry.tool
        request.arguments_json = entry.arguments_json
        request.descriptor_digest = entry.descriptor_digest
        request.request_digest = entry.digest
        if entry.expires_at is not None:
            request.expires_at.FromDatetime(entry.expires_at)
    elif isinstance(entry, ApprovalDecisionEntry):
        decided = wire.approval_decision
        decided.call_id = entry.call_id
        decided.decision = DECISION_TO_WIRE[entry.decision]
        decided.request_digest = entry.request_digest
        decided.arguments_json = entry.arguments_json
        decided.reason = entry.reason
        decided.by = entry.by
    elif isinstance(entry, ForkPrefixEntry):
        wire.fork_prefix.messages.extend(
            mesh_pb2.ChatMessage(
                role=message.role.value,
                content=message.content,
                tool_calls=[
                    mesh_pb2.ToolCall(id=c.call_id, name=c.name, arguments_json=c.arguments_json)
                    for c in message.tool_calls
                ],
                tool_call_id=message.tool_call_id or "",
            )
            for message in entry.messages
        )
    return wire


def usage_to_wire(usage: Usage) -> mesh_pb2.Usage:
    """The wire form of one model call's usage."""
    return mesh_pb2.Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
    )


def price_to_wire(model: str, price: ModelPrice) -> mesh_pb2.ModelPrice:
    """The wire form of ``model``'s price (cached input at its own price, or the input's)."""
    return mesh_pb2.ModelPrice(
        model=model,
        input_usd_per_mtok=price.input_usd_per_mtok,
        cached_input_usd_per_mtok=price.cached_input,
        output_usd_per_mtok=price.output_usd_per_mtok,
    )


def session_usage_to_wire(usage: SessionUsage, cost: Cost | None = None) -> mesh_pb2.SessionUsage:
    """The wire form of a session's usage summary (``first_call`` unset when it made none),
    with what it cost when ``cost`` is given."""
    wire = mesh_pb2.SessionUsage(
        model_calls=usage.model_calls,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
    )
    if cost is not None:
        wire.cost_usd = cost.usd
        wire.unpriced_calls = cost.unpriced_calls
    if usage.first_call is not None:
        wire.first_call.CopyFrom(usage_to_wire(usage.first_call))
    return wire
