"""Calls from this node to the other nodes of its cluster, one reused channel per node."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from dsh_mesh import telemetry
from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentRef,
    ApprovalDecisionEntry,
    Delivery,
    DeliveryKind,
    NodeId,
    PeerUnavailable,
    SessionId,
    SettlementNoticeEntry,
    TurnId,
)
from dsh_mesh.runtime import Delta
from dsh_mesh.transport._auth import DECIDED_BY_HEADER, ClusterCredential, call_metadata
from dsh_mesh.transport._convert import (
    DECISION_TO_WIRE,
    agent_ref_to_wire,
    delivery_from_wire,
    notice_to_wire,
)
from dsh_mesh.transport._deltas import delta_from_wire
from dsh_mesh.transport._link import LinkUnsupported, MessageLink
from dsh_mesh.transport._status import error_from_rpc
from dsh_mesh.transport._tls import TlsCredentials, secure_channel

R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class PeerTimeouts:
    """Deadlines of node-to-node calls. A send may include a cold resume, so it gets longer."""

    send: timedelta = timedelta(seconds=30)
    control: timedelta = timedelta(seconds=10)


class PeerPool:
    """Channels to the other nodes, found by ``address_of``. Use ``async with``; :meth:`close`
    is idempotent. Every call raises a ``MeshError`` (never a raw ``grpc.RpcError``).

    With ``tls`` every channel is mutual TLS: this node presents its certificate, trusts only
    the cluster CA, and requires the dialed node's certificate to name the node id it dials
    (``grpc.ssl_target_name_override``), so a process at a registered address that holds
    another name's certificate fails the handshake (``PEER_UNAVAILABLE``). Without ``tls`` the
    channels are plaintext (an explicit choice of the node's configuration).
    """

    def __init__(
        self,
        *,
        node_id: NodeId,
        credential: ClusterCredential | None,
        address_of: Callable[[NodeId], str | None],
        timeouts: PeerTimeouts | None = None,
        tls: TlsCredentials | None = None,
    ) -> None:
        self._node_id = node_id
        self._credential = credential
        self._address_of = address_of
        self._timeouts = timeouts or PeerTimeouts()
        self._tls = tls
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._links: dict[grpc.aio.Channel, MessageLink] = {}
        """This node's message stream on each channel (ADR 0047)."""

    async def __aenter__(self) -> PeerPool:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every message stream and channel. Idempotent."""
        links, self._links = self._links, {}
        for link in links.values():
            await link.aclose()
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def metadata(self, *, hops: int = 1) -> tuple[tuple[str, str], ...]:
        """The call metadata this node sends: its credential, its id, the hop count."""
        return call_metadata(self._credential, self._node_id, hops=hops)

    def channel(self, node: NodeId) -> grpc.aio.Channel:
        """The reused channel to ``node``; raises ``PeerUnavailable`` for an unknown node."""
        address = self._address_of(node)
        if address is None:
            raise PeerUnavailable(f"node {node} is not registered")
        # Keyed by node as well: under TLS the channel checks the node id it was opened for.
        key = (node, address)
        channel = self._channels.get(key)
        if channel is None:
            if self._tls is not None:
                channel = secure_channel(
                    address,
                    self._tls,
                    server_name=node,
                    interceptors=telemetry.client_interceptors(),
                )
            else:
                channel = grpc.aio.insecure_channel(
                    address, interceptors=telemetry.client_interceptors()
                )
            self._channels[key] = channel
        return channel

    async def _call(
        self,
        rpc: Callable[..., Awaitable[R]],
        request: Any,
        *,
        deadline: timedelta,
        hops: int,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> R:
        """One unary call with this node's metadata (and ``extra``); a failure becomes its
        ``MeshError``."""
        try:
            return await rpc(
                request,
                timeout=deadline.total_seconds(),
                metadata=self.metadata(hops=hops) + extra,
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error

    def _link(self, node: NodeId, channel: grpc.aio.Channel) -> MessageLink:
        link = self._links.get(channel)
        if link is None:
            stub = peer_pb2_grpc.MeshPeerStub(channel)
            link = MessageLink(lambda: stub.SendMessages(metadata=self.metadata(hops=0)), node=node)
            self._links[channel] = link
        return link

    def _control(self, node: NodeId) -> Any:
        return mesh_pb2_grpc.MeshControlStub(self.channel(node))

    def _peer(self, node: NodeId) -> Any:
        return peer_pb2_grpc.MeshPeerStub(self.channel(node))

    async def hand_on_message(
        self,
        node: NodeId,
        sender: AgentRef,
        target: SessionId,
        content: str,
        *,
        idempotency_key: str | None,
        hops: int,
    ) -> Delivery:
        """The message to ``node``, as this node, for ``sender``: on this node's message stream
        to it (``MeshPeer.SendMessages``), or by ``AgentMesh.SendMessage`` to a node that does
        not serve the stream."""
        channel = self.channel(node)
        request = mesh_pb2.SendMessageRequest(
            sender=agent_ref_to_wire(sender),
            agent_id=target,
            message=content,
            idempotency_key=idempotency_key or secrets.token_hex(16),
        )
        link = self._link(node, channel)
        if not link.unsupported:
            try:
                answer = await link.send(request, hops=hops, deadline=self._timeouts.send)
                return delivery_from_wire(target, answer)
            except LinkUnsupported:
                pass  # a node of an older release: by unary call
        stub: Any = mesh_pb2_grpc.AgentMeshStub(channel)
        response = await self._call(
            stub.SendMessage, request, deadline=self._timeouts.send, hops=hops
        )
        return delivery_from_wire(target, response)

    async def submit_prompt(
        self, node: NodeId, session: SessionId, text: str, *, idempotency_key: str | None
    ) -> Delivery:
        """``MeshControl.SubmitPrompt`` on ``node``, handed on once (it does not hand it on
        again). Only the seq and ``duplicate`` travel back; a prompt starts a turn of its own."""
        request = mesh_pb2.SubmitPromptRequest(
            session_id=session, text=text, idempotency_key=idempotency_key or secrets.token_hex(16)
        )
        response = await self._call(
            self._control(node).SubmitPrompt, request, deadline=self._timeouts.send, hops=1
        )
        return Delivery(
            target=session,
            target_activation=ActivationId(""),
            kind=DeliveryKind.STARTED_TURN,
            accepted_seq=response.accepted_seq,
            duplicate=response.duplicate,
        )

    async def resolve_approval(
        self, node: NodeId, session: SessionId, decision: ApprovalDecisionEntry
    ) -> Delivery:
        """``MeshControl.ResolveApproval`` on ``node``, handed on once, naming who decided (a
        node's word for it is taken: it authenticated the decider)."""
        request = mesh_pb2.ResolveApprovalRequest(
            session_id=session,
            call_id=decision.call_id,
            decision=DECISION_TO_WIRE[decision.decision],
            request_digest=decision.request_digest,
            arguments_json=decision.arguments_json,
            reason=decision.reason,
        )
        response = await self._call(
            self._control(node).ResolveApproval,
            request,
            deadline=self._timeouts.send,
            hops=1,
            extra=((DECIDED_BY_HEADER, decision.by),),
        )
        return Delivery(
            target=session,
            target_activation=ActivationId(""),
            kind=DeliveryKind.STEERED,
            accepted_seq=response.accepted_seq,
            duplicate=response.duplicate,
        )

    async def interrupt(self, node: NodeId, session: SessionId) -> TurnId | None:
        """``MeshControl.Interrupt`` on ``node``, which hosts ``session``."""
        request = mesh_pb2.InterruptRequest(session_id=session)
        response = await self._call(
            self._control(node).Interrupt, request, deadline=self._timeouts.send, hops=1
        )
        return TurnId(response.turn_id) if response.interrupted else None

    async def create_root(
        self,
        node: NodeId,
        *,
        request_id: str,
        task: str,
        preset: str,
        model: str,
        namespace: str = "",
        output_schema: str = "",
    ) -> Activation:
        """``MeshControl.CreateRootSession`` on ``node``: the root it made (or found) and where
        it runs (empty activation and node while nothing runs it)."""
        request = mesh_pb2.CreateRootSessionRequest(
            request_id=request_id,
            initial_task=task,
            preset=preset,
            model=model,
            node_id=node,
            namespace=namespace,
            output_schema_json=output_schema,
        )
        response = await self._call(
            self._control(node).CreateRootSession, request, deadline=self._timeouts.send, hops=1
        )
        return Activation(
            session_id=SessionId(response.session_id),
            activation_id=ActivationId(response.activation_id),
            node_id=NodeId(response.node_id),
        )

    async def get_session(
        self, node: NodeId, request: mesh_pb2.GetSessionRequest
    ) -> mesh_pb2.Session:
        """``MeshControl.GetSession`` on ``node``, which hosts the session (and knows whether a
        turn runs)."""
        response: mesh_pb2.Session = await self._call(
            self._control(node).GetSession, request, deadline=self._timeouts.send, hops=1
        )
        return response

    async def activate(
        self, node: NodeId, session: SessionId, parent_activation: ActivationId | None
    ) -> Activation:
        """``MeshPeer.Activate`` on ``node``: make ``session`` resident there."""
        request = peer_pb2.ActivateRequest(
            session_id=session, parent_activation_id=parent_activation or ""
        )
        response = await self._call(
            self._peer(node).Activate, request, deadline=self._timeouts.send, hops=0
        )
        return Activation(
            session_id=session,
            activation_id=ActivationId(response.activation_id),
            node_id=NodeId(response.node_id),
            parent_activation=ActivationId(response.parent_activation_id) or None,
        )

    async def deliver_notice(
        self, node: NodeId, parent: SessionId, notice: SettlementNoticeEntry
    ) -> None:
        """``MeshPeer.DeliverNotice`` on ``node``, the node hosting ``parent``."""
        await self._call(
            self._peer(node).DeliverNotice,
            notice_to_wire(parent, notice),
            deadline=self._timeouts.control,
            hops=0,
        )

    async def watch_deltas(self, node: NodeId, session: SessionId) -> AsyncIterator[Delta]:
        """``MeshPeer.WatchDeltas`` on ``node``, which hosts ``session``: its deltas until the
        caller stops iterating (the call is cancelled then) or the stream ends. No deadline:
        it lasts as long as the watch that asked. A failure raises its ``MeshError``."""
        call = self._peer(node).WatchDeltas(
            peer_pb2.WatchDeltasRequest(session_id=session), metadata=self.metadata(hops=0)
        )
        try:
            async for response in call:
                if response.HasField("delta"):  # else a heartbeat: the stream is alive
                    yield delta_from_wire(session, response.delta)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()
