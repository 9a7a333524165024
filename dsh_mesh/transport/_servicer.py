"""The gRPC servicers a node exposes: the public ``AgentMesh`` and the internal ``MeshPeer``.

They translate between the wire and the continuation manager and do nothing else; every
decision (authorization, residency, delivery) is the manager's, re-checked on this node from its
own registry view. The only thing checked here is the caller: a sender must be hosted by the
node whose credential made the call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from dsh_mesh import telemetry
from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentRef,
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    NodeId,
    NodeOverloaded,
    Rejected,
    RejectionReason,
    SessionId,
    SessionUnknown,
    StaleSender,
    TargetElsewhere,
    bounded_quote,
    parse_session_id,
)
from dsh_mesh.runtime import ContinuationManager, DeltaHub
from dsh_mesh.transport._auth import caller_hops, caller_node
from dsh_mesh.transport._convert import (
    agent_ref_from_wire,
    check_bounds,
    delivery_to_wire,
    notice_from_wire,
)
from dsh_mesh.transport._deltas import delta_to_wire
from dsh_mesh.transport._link import SEND_SPAN, SPAN_ATTRIBUTES
from dsh_mesh.transport._status import (
    RemoteError,
    abort_with,
    mesh_rpc,
    refusal,
    target_of,
)

DELTAS_HEARTBEAT_S = 15.0
"""How long a ``WatchDeltas`` stream goes without a delta before it checks that its session is
still resident here and sends a heartbeat (ADR 0053)."""


class ActivationLookup(Protocol):
    """A session's current activation; ``fresh`` asks for etcd itself, not a cache."""

    def __call__(
        self, session: SessionId, *, fresh: bool = False
    ) -> Awaitable[Activation | None]: ...


_log = logging.getLogger(__name__)

MAX_CARRIED = 4096
"""Messages of one ``SendMessages`` stream under way at once on the called node; past it a
message is refused ``NODE_OVERLOADED`` at once (the node's own in-flight limit refuses sooner
as a rule: this bounds the tasks a stream can start)."""

DEFAULT_CARRY_SECONDS = 60.0
"""How long a carried message that names no deadline may take on the called node."""

_Answer = peer_pb2.CarriedAnswer | MeshError | None
"""What a stream's answer queue holds: an answer, the refusal that ends the stream, or its end."""

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
        return await self.receive(request, caller=caller_node(context), hops=caller_hops(context))

    async def receive(
        self, request: mesh_pb2.SendMessageRequest, *, caller: str, hops: int
    ) -> mesh_pb2.SendMessageResponse:
        """One message the node ``caller`` hands to this node (by ``SendMessage`` or inside a
        ``MeshPeer.SendMessages`` frame), handed on ``hops`` times before: its sender checked
        against the caller, then the manager's own authorization and delivery."""
        started = time.monotonic()
        outcome = "error"
        try:
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
                hops=hops,
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
    """What other nodes of the cluster ask of this node's manager, and the stream that carries
    their agent messages to ``messages``, this node's ``SendMessage``."""

    def __init__(
        self, manager: ManagerRef, messages: AgentMeshService, deltas: DeltaHub | None = None
    ) -> None:
        self._manager = manager
        self._messages = messages
        self._deltas = deltas or DeltaHub()

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

    async def WatchDeltas(
        self,
        request: peer_pb2.WatchDeltasRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.WatchDeltasResponse]:
        """The deltas of a session on this node, for the calling node's watch (ADR 0053), until
        it cancels the call, or the session is no longer resident here. Only a node may call
        it (the interceptor, and ``caller_node``); the watch's caller was checked for the
        session where the watch is served.

        A caller that dies is only found on a write: every :data:`DELTAS_HEARTBEAT_S` without
        a delta, the stream ends if the session left this node, else it sends a response
        without a delta (a heartbeat the caller skips), whose write fails once TCP gives up
        on a dead caller."""
        try:
            caller_node(context)
            session = parse_session_id(request.session_id)
            subscription = self._deltas.subscribe([session], peer=True)
        except MeshError as refused:
            await abort_with(context, refused)
        with subscription:
            while True:
                try:
                    delta = await asyncio.wait_for(subscription.get(), DELTAS_HEARTBEAT_S)
                except TimeoutError:
                    if not self._resident(session):
                        return
                    yield peer_pb2.WatchDeltasResponse()
                    continue
                yield peer_pb2.WatchDeltasResponse(delta=delta_to_wire(delta))

    def _resident(self, session: SessionId) -> bool:
        """Whether ``session`` is resident on this node (held, or being woken), as far as this
        node's manager knows; a fenced node hosts nothing."""
        try:
            manager = self._manager()
        except MeshError:
            return False
        return manager.agent(session) is not None or manager.waking(session) > 0

    async def SendMessages(
        self,
        requests: AsyncIterator[peer_pb2.SendMessagesRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.SendMessagesResponse]:
        """Carry the calling node's messages, each as ``SendMessage`` would (ADR 0047), and
        answer each once, in frames of every answer ready together."""
        try:
            caller = caller_node(context)
        except MeshError as refused:
            await abort_with(context, refused)
        answers: asyncio.Queue[_Answer] = asyncio.Queue()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._take(requests, caller, answers))
            frame: list[peer_pb2.CarriedAnswer] = []
            while True:
                item = await answers.get() if not frame else answers.get_nowait()
                if isinstance(item, peer_pb2.CarriedAnswer):
                    frame.append(item)
                    if not answers.empty():
                        continue  # every answer ready now goes in this frame
                if frame:
                    yield peer_pb2.SendMessagesResponse(answers=frame)
                    frame = []
                if not isinstance(item, peer_pb2.CarriedAnswer):
                    ended = item
                    break
        if isinstance(ended, MeshError):
            await abort_with(context, ended)

    async def _take(
        self,
        requests: AsyncIterator[peer_pb2.SendMessagesRequest],
        caller: str,
        answers: asyncio.Queue[_Answer],
    ) -> None:
        """Start each carried message's work as its frame comes; once the caller closed its
        side and every answer is in, end the answers (with the refusal of a frame that did
        not decode, if one came: the stream then ends with it)."""
        carrying: set[asyncio.Task[None]] = set()
        ended: MeshError | None = None
        async with asyncio.TaskGroup() as group:
            try:
                async for frame in requests:
                    for message in frame.messages:
                        # Answers not yet read by the caller count too: they are memory.
                        if len(carrying) + answers.qsize() >= MAX_CARRIED:
                            busy = NodeOverloaded(
                                f"{MAX_CARRIED} messages of this stream are under way already"
                            )
                            answers.put_nowait(_refused(message, busy))
                            continue
                        task = group.create_task(self._carry(message, caller, answers))
                        carrying.add(task)
                        task.add_done_callback(carrying.discard)
            except MeshError as refused:  # a frame that did not decode: answer the rest first
                ended = refused
        answers.put_nowait(ended)

    async def _carry(
        self,
        message: peer_pb2.CarriedMessage,
        caller: str,
        answers: asyncio.Queue[_Answer],
    ) -> None:
        """One carried message's answer, whatever happens to it (never raises)."""
        timeout = message.timeout_ms / 1000 if message.timeout_ms else DEFAULT_CARRY_SECONDS
        try:
            with (
                telemetry.carried_context(message.context),
                telemetry.span(SEND_SPAN, kind="server", attributes=SPAN_ATTRIBUTES),
            ):
                async with asyncio.timeout(timeout):
                    response = await self._messages.receive(
                        message.request, caller=caller, hops=message.hops
                    )
            answers.put_nowait(peer_pb2.CarriedAnswer(id=message.id, accepted=response))
        except MeshError as refused:
            answers.put_nowait(_refused(message, refused))
        except TimeoutError:
            late = DeadlineExceeded(
                f"the sender's deadline ({message.timeout_ms} ms) passed before an answer"
            )
            answers.put_nowait(_refused(message, late))
        except Exception as error:  # a defect answers this message, and ends nothing else
            _log.exception("carrying a message failed")
            fault = RemoteError(grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
            answers.put_nowait(_refused(message, fault))


def _refused(message: peer_pb2.CarriedMessage, error: MeshError) -> peer_pb2.CarriedAnswer:
    return peer_pb2.CarriedAnswer(
        id=message.id, refused=refusal(error, target=target_of(message.request))
    )
