"""The one place where wire messages become domain values and back (the transport edge)."""

from __future__ import annotations

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    ActivationId,
    AgentRef,
    Delivery,
    DeliveryKind,
    InvalidArgument,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    SettlementOutcome,
    parse_session_id,
)

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
    )
    return parse_session_id(request.parent_session_id), notice
