"""Acting as a node of a test cluster: the calls a node makes, made by the test itself over
real gRPC, so every refusal can be provoked and its status and reason read back."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AgentMessageEntry,
    AgentRef,
    MeshError,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
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
