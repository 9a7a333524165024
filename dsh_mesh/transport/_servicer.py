"""The gRPC servicers a node exposes: the public ``AgentMesh`` and the internal ``MeshPeer``.

They translate between the wire and the continuation manager and do nothing else; every
decision (authorization, residency, delivery) is the manager's, re-checked on this node from its
own registry view. The only thing checked here is the caller: a sender must be hosted by the
node whose credential made the call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from dsh_mesh import telemetry
from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentRef,
    InvalidArgument,
    NodeId,
    Rejected,
    RejectionReason,
    SessionId,
    SessionUnknown,
    StaleSender,
    TargetElsewhere,
    bounded_quote,
    parse_session_id,
)
from dsh_mesh.runtime import ContinuationManager
from dsh_mesh.transport._auth import caller_hops, caller_node
from dsh_mesh.transport._convert import (
    agent_ref_from_wire,
    check_bounds,
    delivery_to_wire,
    notice_from_wire,
)
from dsh_mesh.transport._status import mesh_rpc


class ActivationLookup(Protocol):
    """A session's current activation; ``fresh`` asks for etcd itself, not a cache."""

    def __call__(
        self, session: SessionId, *, fresh: bool = False
    ) -> Awaitable[Activation | None]: ...


ManagerRef = Callable[[], ContinuationManager]
"""The node's current manager; raises ``NodeFenced`` while the node has none (no lease)."""


class AgentMeshService(mesh_pb2_grpc.AgentMeshServicer):
    """``SendMessage``: a sender's node hands its agent's message to this node."""

    def __init__(self, manager: ManagerRef, current_activation: ActivationLookup) -> None:
        self._manager = manager
        self._current_activation = current_activation

    @mesh_rpc
    async def SendMessage(
        self,
        request: mesh_pb2.SendMessageRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.SendMessageResponse:
        started = time.monotonic()
        outcome = "error"
        try:
            caller = caller_node(context)
            manager = self._manager()  # a fenced node refuses at once, before any etcd read
            check_bounds(request)
            sender = agent_ref_from_wire(request.sender)
            if not request.idempotency_key:
                raise InvalidArgument("idempotency_key is required")
            await self._check_hosted_by(sender, caller, manager)
            delivery = await manager.handed_on(
                sender,
                request.agent_id,
                request.message,
                idempotency_key=request.idempotency_key,
                hops=caller_hops(context),
            )
            outcome = "duplicate" if delivery.duplicate else "accepted"
            return delivery_to_wire(delivery)
        except Rejected as refused:
            outcome = refused.reason.value
            raise
        finally:
            telemetry.send_duration(time.monotonic() - started, outcome)

    async def _check_hosted_by(
        self, sender: AgentRef, caller: str, manager: ContinuationManager
    ) -> None:
        """The sender is the current activation of a session the calling node hosts: else
        UNKNOWN_SENDER (no such session), STALE_SENDER (not its current activation) or
        FORGED_SENDER (hosted by another node)."""
        current = await self._current_activation(sender.session_id)
        if current is None or current.activation_id != sender.activation_id:
            current = await self._current_activation(sender.session_id, fresh=True)
        if current is None:
            try:
                await manager.header(sender.session_id)
            except SessionUnknown:
                telemetry.message_rejected(RejectionReason.UNKNOWN_SENDER.value)
                raise Rejected.of(
                    RejectionReason.UNKNOWN_SENDER, f"no session {sender.session_id}"
                ) from None
        if current is None or current.activation_id != sender.activation_id:
            telemetry.message_rejected(RejectionReason.STALE_SENDER.value)
            shown = bounded_quote(sender.activation_id)
            raise StaleSender(f"{sender.session_id} activation {shown} is not current")
        if current.node_id != caller:
            telemetry.message_rejected(RejectionReason.FORGED_SENDER.value)
            raise Rejected.of(
                RejectionReason.FORGED_SENDER,
                f"{sender.session_id} is not hosted by the calling node {caller}",
            )


class MeshPeerService(peer_pb2_grpc.MeshPeerServicer):
    """What other nodes of the cluster ask of this node's manager."""

    def __init__(self, manager: ManagerRef) -> None:
        self._manager = manager

    @mesh_rpc
    async def Activate(
        self,
        request: peer_pb2.ActivateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> peer_pb2.ActivateResponse:
        caller_node(context)
        session = parse_session_id(request.session_id)
        parent = ActivationId(request.parent_activation_id) or None
        try:
            activation = await self._manager().resume(session, parent)
        except TargetElsewhere as held:
            activation = Activation(
                session_id=session,
                activation_id=ActivationId(held.activation_id),
                node_id=NodeId(held.node_id),
            )
        return peer_pb2.ActivateResponse(
            activation_id=activation.activation_id,
            parent_activation_id=activation.parent_activation or "",
            node_id=activation.node_id,
        )

    @mesh_rpc
    async def DeliverNotice(
        self,
        request: peer_pb2.DeliverNoticeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> peer_pb2.DeliverNoticeResponse:
        caller_node(context)
        parent, notice = notice_from_wire(request)
        await self._manager().deliver_notice(parent, notice)
        return peer_pb2.DeliverNoticeResponse()
