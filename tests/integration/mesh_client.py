"""Acting as a node of a test cluster: the calls a node makes, made by the test itself over
real gRPC, so every refusal can be provoked and its status and reason read back."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Sequence

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AgentMessageEntry,
    AgentRef,
    MeshError,
    Record,
    Rejected,
    SessionHeader,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    TurnEndedEntry,
)
from dsh_mesh.testing import LocalCluster, MeshReader, create_root
from dsh_mesh.transport import error_from_rpc

HUMAN = "test-client"


async def send_as(
    cluster: LocalCluster,
    *,
    via: str,
    caller: str | None,
    sender: AgentRef,
    target: str,
    message: str = "hello",
    key: str | None = None,
    hops: int = 0,
) -> mesh_pb2.SendMessageResponse:
    """``SendMessage`` on node ``via``, presenting the cluster token as node ``caller``
    (``None``: no credential at all). Raises the decoded ``MeshError`` on refusal."""
    metadata: Sequence[tuple[str, str]] = ()
    if caller is not None:
        metadata = tuple(
            (k, str(hops) if k == "x-dsh-hops" else v) for k, v in cluster.metadata(caller)
        )
    request = mesh_pb2.SendMessageRequest(
        sender=mesh_pb2.AgentRef(session_id=sender.session_id, activation_id=sender.activation_id),
        agent_id=target,
        message=message,
        idempotency_key=key or secrets.token_hex(8),
    )
    address = cluster[via].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.AgentMeshStub(channel)
        try:
            response: mesh_pb2.SendMessageResponse = await stub.SendMessage(
                request, metadata=metadata, timeout=30
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
    return response


async def started_child(cluster: LocalCluster, reader: MeshReader) -> tuple[SessionId, SessionId]:
    """Create a root on node-a whose scenario spawns one child; return (root, child) once the
    child's first message has reached the root."""
    root = await create_root(cluster, on="node-a", task="Delegate.")
    children = await reader.wait_for(
        lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
    )
    await reader.wait_for(
        lambda: reader.transcript(root),
        lambda records: any(isinstance(r.entry, AgentMessageEntry) for r in records),
        what="the child's first message",
    )
    return root, children[0].session_id


async def live_ref(reader: MeshReader, session: SessionId) -> tuple[AgentRef, str]:
    """The session's exact live sender reference and the node hosting it."""
    activation = await reader.activation(session)
    assert activation is not None, f"{session} is not resident"
    return AgentRef(session_id=session, activation_id=activation.activation_id), activation.node_id


async def children_of(reader: MeshReader, parent: SessionId) -> list[SessionHeader]:
    """The headers of ``parent``'s children, in creation order unknown (sorted by preset, id)."""
    return sorted(
        (h for h in await reader.sessions() if h.parent_session == parent),
        key=lambda h: (h.spec.preset, h.kind is SessionKind.ONE_SHOT_CHILD, h.session_id),
    )


def notices(records: list[Record]) -> list[SettlementNoticeEntry]:
    """The settlement notices among ``records``, in seq order."""
    return [r.entry for r in records if isinstance(r.entry, SettlementNoticeEntry)]


def messages(records: list[Record]) -> list[AgentMessageEntry]:
    """The agent messages among ``records``, in seq order."""
    return [r.entry for r in records if isinstance(r.entry, AgentMessageEntry)]


__all__ = [
    "HUMAN",
    "MeshError",
    "children_of",
    "create_root",
    "live_ref",
    "messages",
    "notices",
    "send_as",
    "started_child",
]


async def resolve_until_accepted(
    cluster: LocalCluster, node: str, request: mesh_pb2.ResolveApprovalRequest
) -> mesh_pb2.ResolveApprovalResponse:
    """Decide through ``node``, retrying what a failover answers, for at most 60 s."""
    deadline = time.monotonic() + 60
    async with cluster.channel(node) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            try:
                response: mesh_pb2.ResolveApprovalResponse = await stub.ResolveApproval(
                    request, metadata=cluster.metadata("tester"), timeout=30
                )
                return response
            except grpc.aio.AioRpcError as failure:
                error = error_from_rpc(failure)
                if not (isinstance(error, Rejected) and error.retryable):
                    raise
                assert time.monotonic() < deadline, f"never accepted: {error}"
                await asyncio.sleep(0.2)


async def stopped_at_the_call(reader: MeshReader, root: SessionId) -> list[Record]:
    """``root``'s transcript once its first turn ended, waiting at its marked call."""
    records: list[Record] = await reader.wait_for(
        lambda: reader.transcript(root),
        lambda rs: any(isinstance(r.entry, TurnEndedEntry) for r in rs),
        what="the turn stopped at the call",
    )
    return records


async def list_approvals(
    cluster: LocalCluster, node: str, root: SessionId
) -> mesh_pb2.ListApprovalsResponse:
    """What ``node`` lists of the approvals waiting in ``root``'s tree."""
    async with cluster.channel(node) as channel:
        response: mesh_pb2.ListApprovalsResponse = await mesh_pb2_grpc.MeshControlStub(
            channel
        ).ListApprovals(
            mesh_pb2.ListApprovalsRequest(root_session_id=root),
            metadata=cluster.metadata("tester"),
            timeout=30,
        )
        return response


async def prompt_until_accepted(cluster: LocalCluster, node: str, session: SessionId) -> None:
    """Submit a prompt through ``node``, retrying what a failover answers, for at most 60 s."""
    request = mesh_pb2.SubmitPromptRequest(
        session_id=session, text="Still there?", idempotency_key=f"long-{uuid.uuid4()}"
    )
    deadline = time.monotonic() + 60
    async with cluster.channel(node) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            try:
                await stub.SubmitPrompt(request, metadata=cluster.metadata("tester"), timeout=30)
                return
            except grpc.aio.AioRpcError as failure:
                error = error_from_rpc(failure)
                if not (isinstance(error, Rejected) and error.retryable):
                    raise
                assert time.monotonic() < deadline, f"never accepted: {error}"
                await asyncio.sleep(0.2)
