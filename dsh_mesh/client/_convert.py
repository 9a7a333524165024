"""The client's one conversion point: ``dsh.mesh.v1`` messages become the dataclasses of
:mod:`dsh_mesh.client._types` here and nowhere else. Pure; never raises on a well-formed message
from a newer server (unknown enum values become ``None``, an unknown entry body
:class:`UnknownEntry`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf import timestamp_pb2

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.client._types import (
    AgentMessage,
    AgentState,
    AgentSummary,
    AnswerRejected,
    ApprovalDecided,
    ApprovalRequest,
    AssistantStep,
    Compaction,
    Consumed,
    EntryBody,
    ForkPrefix,
    HumanPrompt,
    PendingApproval,
    SessionEvent,
    SessionInfo,
    SessionPage,
    SettlementNotice,
    Task,
    TextDelta,
    ToolOutputsCleared,
    ToolResult,
    TranscriptEntry,
    TurnEnded,
    TurnStarted,
    UnknownEntry,
)
from dsh_mesh.core import (
    Activation,
    ActivationId,
    ApprovalDecision,
    ChatMessage,
    Cost,
    DeliveryKind,
    ForkOrigin,
    ModelPrice,
    NodeId,
    Role,
    SessionId,
    SessionKind,
    SessionUsage,
    SettlementOutcome,
    ToolCall,
    ToolDescriptor,
    TurnId,
    TurnOutcome,
    Usage,
)

_KIND = {
    mesh_pb2.SESSION_KIND_ROOT: SessionKind.ROOT,
    mesh_pb2.SESSION_KIND_CONTINUABLE_CHILD: SessionKind.CONTINUABLE_CHILD,
    mesh_pb2.SESSION_KIND_ONE_SHOT_CHILD: SessionKind.ONE_SHOT_CHILD,
}
_STATE = {
    mesh_pb2.AGENT_STATE_IDLE: AgentState.IDLE,
    mesh_pb2.AGENT_STATE_RUNNING: AgentState.RUNNING,
    mesh_pb2.AGENT_STATE_ABSENT: AgentState.ABSENT,
    mesh_pb2.AGENT_STATE_RESIDENT: AgentState.RESIDENT,
}
_DELIVERY = {
    mesh_pb2.DELIVERY_STEERED: DeliveryKind.STEERED,
    mesh_pb2.DELIVERY_STARTED_TURN: DeliveryKind.STARTED_TURN,
    mesh_pb2.DELIVERY_COLD_RESUMED: DeliveryKind.COLD_RESUMED,
}
_SETTLEMENT = {
    mesh_pb2.SETTLEMENT_OUTCOME_COMPLETED: SettlementOutcome.COMPLETED,
    mesh_pb2.SETTLEMENT_OUTCOME_ERROR: SettlementOutcome.ERROR,
    mesh_pb2.SETTLEMENT_OUTCOME_CANCELLED: SettlementOutcome.CANCELLED,
    mesh_pb2.SETTLEMENT_OUTCOME_TOKEN_EXHAUSTION: SettlementOutcome.TOKEN_EXHAUSTION,
    mesh_pb2.SETTLEMENT_OUTCOME_LOST: SettlementOutcome.LOST,
}
_TURN = {
    mesh_pb2.TURN_OUTCOME_COMPLETED: TurnOutcome.COMPLETED,
    mesh_pb2.TURN_OUTCOME_ERROR: TurnOutcome.ERROR,
    mesh_pb2.TURN_OUTCOME_CANCELLED: TurnOutcome.CANCELLED,
    mesh_pb2.TURN_OUTCOME_TOKEN_EXHAUSTION: TurnOutcome.TOKEN_EXHAUSTION,
    mesh_pb2.TURN_OUTCOME_LOST: TurnOutcome.LOST,
    mesh_pb2.TURN_OUTCOME_AWAITING_APPROVAL: TurnOutcome.AWAITING_APPROVAL,
}
_DECISION = {
    mesh_pb2.APPROVAL_DECISION_ALLOW: ApprovalDecision.ALLOW,
    mesh_pb2.APPROVAL_DECISION_DENY: ApprovalDecision.DENY,
    mesh_pb2.APPROVAL_DECISION_EDIT: ApprovalDecision.EDIT,
}
DECISION_TO_WIRE = {decision: wire for wire, decision in _DECISION.items()}


def _time(message: Any, field: str) -> datetime | None:
    if not message.HasField(field):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, field)
    return stamp.ToDatetime(tzinfo=UTC)


def activation_from_wire(info: mesh_pb2.ActivationInfo) -> Activation:
    """A wire ``ActivationInfo`` as the core :class:`Activation` (empty parent: ``None``)."""
    return Activation(
        session_id=SessionId(info.session_id),
        activation_id=ActivationId(info.activation_id),
        node_id=NodeId(info.node_id),
        parent_activation=ActivationId(info.parent_activation_id)
        if info.parent_activation_id
        else None,
    )


def _optional_activation(message: Any, field: str) -> Activation | None:
    return activation_from_wire(getattr(message, field)) if message.HasField(field) else None


def info_from_wire(header: mesh_pb2.SessionHeader) -> SessionInfo:
    """A wire ``SessionHeader`` as :class:`SessionInfo`."""
    fork = None
    if header.HasField("fork_origin"):
        fork = ForkOrigin(
            parent_session=SessionId(header.fork_origin.parent_session_id),
            prefix_seq=header.fork_origin.prefix_seq,
        )
    return SessionInfo(
        session_id=SessionId(header.session_id),
        kind=_KIND.get(header.kind),
        parent_session=SessionId(header.parent_session_id) if header.parent_session_id else None,
        preset=header.spec.preset,
        model=header.spec.model,
        tools=tuple(
            ToolDescriptor(
                name=tool.name,
                description=tool.description,
                input_schema_json=tool.input_schema_json,
            )
            for tool in header.spec.tools
        ),
        output_schema=header.spec.output_schema_json,
        fork_origin=fork,
        created_at=_time(header, "created_at"),
        namespace=header.namespace or "default",
    )


def _body_from_wire(entry: mesh_pb2.TranscriptEntry) -> EntryBody:
    which = entry.WhichOneof("body")
    if which == "task":
        return Task(content=entry.task.content)
    if which == "human_prompt":
        prompt = entry.human_prompt
        return HumanPrompt(content=prompt.content, idempotency_key=prompt.idempotency_key)
    if which == "agent_message":
        message = entry.agent_message
        return AgentMessage(
            sender=SessionId(message.source.sender_session_id),
            content=message.content,
            idempotency_key=message.idempotency_key,
            delivery=_DELIVERY.get(message.delivery),
            trace=message.trace,
        )
    if which == "settlement_notice":
        notice = entry.settlement_notice
        return SettlementNotice(
            child_session=SessionId(notice.child_session_id),
            child_activation=ActivationId(notice.child_activation_id),
            outcome=_SETTLEMENT.get(notice.outcome),
            terminal_output=notice.terminal_output,
            detail=notice.detail,
            output_json=notice.output_json,
        )
    if which == "assistant_step":
        step = entry.assistant_step
        return AssistantStep(
            text=step.text,
            tool_calls=tuple(
                ToolCall(call_id=call.id, name=call.name, arguments_json=call.arguments_json)
                for call in step.tool_calls
            ),
            usage=usage_from_wire(step.usage),
        )
    if which == "tool_result":
        result = entry.tool_result
        return ToolResult(
            call_id=result.call_id,
            name=result.name,
            content=result.content,
            is_error=result.is_error,
            duration_ms=result.duration_ms,
        )
    if which == "turn_started":
        started = entry.turn_started
        return TurnStarted(
            turn_id=TurnId(started.turn_id),
            node_id=NodeId(started.node_id) if started.node_id else None,
            activation_id=ActivationId(started.activation_id) if started.activation_id else None,
            trace=started.trace,
        )
    if which == "turn_ended":
        ended = entry.turn_ended
        return TurnEnded(
            turn_id=TurnId(ended.turn_id),
            outcome=_TURN.get(ended.outcome),
            detail=ended.detail,
            output_json=ended.output_json,
        )
    if which == "answer_rejected":
        rejected = entry.answer_rejected
        return AnswerRejected(reason=rejected.reason, schema_json=rejected.schema_json)
    if which == "consumed":
        return Consumed(seqs=tuple(entry.consumed.seqs))
    if which == "compaction":
        compaction = entry.compaction
        return Compaction(
            summary=compaction.summary,
            from_seq=compaction.from_seq,
            through_seq=compaction.through_seq,
            task=compaction.task,
            pending=tuple(compaction.pending),
            model=compaction.model,
            usage=usage_from_wire(compaction.usage),
        )
    if which == "tool_outputs_cleared":
        return ToolOutputsCleared(seqs=tuple(entry.tool_outputs_cleared.seqs))
    if which == "approval_request":
        return request_from_wire(entry.approval_request)
    if which == "approval_decision":
        decided = entry.approval_decision
        return ApprovalDecided(
            call_id=decided.call_id,
            decision=_DECISION.get(decided.decision),
            request_digest=decided.request_digest,
            arguments_json=decided.arguments_json,
            reason=decided.reason,
            by=decided.by,
        )
    if which == "fork_prefix":
        return ForkPrefix(messages=tuple(_message(m) for m in entry.fork_prefix.messages))
    return UnknownEntry()


_ROLES = {role.value: role for role in Role}


def _message(message: mesh_pb2.ChatMessage) -> ChatMessage:
    """A wire ``ChatMessage``; a role this client does not know reads as the user's."""
    return ChatMessage(
        role=_ROLES.get(message.role, Role.USER),
        content=message.content,
        tool_calls=tuple(
            ToolCall(call_id=call.id, name=call.name, arguments_json=call.arguments_json)
            for call in message.tool_calls
        ),
        tool_call_id=message.tool_call_id or None,
    )


def request_from_wire(request: mesh_pb2.ApprovalRequestEntry) -> ApprovalRequest:
    """A wire ``ApprovalRequestEntry`` as the client's :class:`ApprovalRequest`."""
    return ApprovalRequest(
        call_id=request.call_id,
        tool=request.tool,
        arguments_json=request.arguments_json,
        descriptor_digest=request.descriptor_digest,
        request_digest=request.request_digest,
        expires_at=_time(request, "expires_at"),
        step_seq=request.step_seq,
    )


def pending_from_wire(pending: mesh_pb2.PendingApproval) -> PendingApproval:
    """One ``ListApprovals`` line."""
    return PendingApproval(
        session_id=SessionId(pending.session_id),
        seq=pending.seq,
        requested_at=_time(pending, "requested_at"),
        request=request_from_wire(pending.request),
    )


def usage_from_wire(usage: mesh_pb2.Usage) -> Usage:
    """One model call's wire ``Usage`` as the core :class:`Usage`."""
    return Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
    )


def session_usage_from_wire(usage: mesh_pb2.SessionUsage) -> SessionUsage:
    """A wire ``SessionUsage`` as the core :class:`SessionUsage` (``first_call`` unset:
    ``None``)."""
    return SessionUsage(
        model_calls=usage.model_calls,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
        first_call=usage_from_wire(usage.first_call) if usage.HasField("first_call") else None,
    )


def price_from_wire(price: mesh_pb2.ModelPrice) -> ModelPrice:
    """A wire ``ModelPrice`` as the core :class:`ModelPrice`."""
    return ModelPrice(
        input_usd_per_mtok=price.input_usd_per_mtok,
        cached_input_usd_per_mtok=price.cached_input_usd_per_mtok,
        output_usd_per_mtok=price.output_usd_per_mtok,
    )


def cost_from_wire(usage: mesh_pb2.SessionUsage) -> Cost | None:
    """What a wire ``SessionUsage`` says its calls cost (``None``: a node older than the
    field, which does not know: never read as free)."""
    if not usage.HasField("cost_usd"):
        return None
    return Cost(usage.cost_usd, usage.unpriced_calls)


def entry_from_wire(entry: mesh_pb2.TranscriptEntry) -> TranscriptEntry:
    """A wire ``TranscriptEntry`` as :class:`TranscriptEntry`."""
    return TranscriptEntry(
        seq=entry.seq, recorded_at=_time(entry, "recorded_at"), body=_body_from_wire(entry)
    )


def session_from_wire(session: mesh_pb2.Session) -> SessionPage:
    """A ``GetSession`` answer as :class:`SessionPage`."""
    return SessionPage(
        info=info_from_wire(session.header),
        activation=_optional_activation(session, "activation"),
        state=_STATE.get(session.state),
        transcript=tuple(entry_from_wire(entry) for entry in session.transcript),
        next_page_token=session.next_page_token,
        usage=session_usage_from_wire(session.usage) if session.HasField("usage") else None,
        cost=cost_from_wire(session.usage),
    )


def summary_from_wire(summary: mesh_pb2.AgentSummary) -> AgentSummary:
    """One ``ListAgents`` line as :class:`AgentSummary`."""
    return AgentSummary(
        info=info_from_wire(summary.header),
        activation=_optional_activation(summary, "activation"),
        state=_STATE.get(summary.state),
        awaiting_approval=(
            summary.awaiting_approval if summary.HasField("awaiting_approval") else None
        ),
    )


def event_from_wire(event: mesh_pb2.SessionEvent) -> SessionEvent:
    """One ``WatchSession`` item as :class:`SessionEvent`."""
    return SessionEvent(
        session_id=SessionId(event.session_id),
        event_seq=event.event_seq,
        entry=entry_from_wire(event.entry) if event.HasField("entry") else None,
        activated=_optional_activation(event, "activated"),
        deactivated=_optional_activation(event, "deactivated"),
        delta=(
            TextDelta(
                turn_id=TurnId(event.delta.turn_id),
                text=event.delta.text,
                dropped=event.delta.dropped,
            )
            if event.HasField("delta")
            else None
        ),
    )
