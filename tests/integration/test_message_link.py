"""The stream that carries a node's agent messages to another node (``MeshPeer.SendMessages``,
ADR 0047).

Against real node processes, a raw client acting as the sender's node: every carried message is
answered once, by its id, with what ``SendMessage`` would answer (an acceptance, a duplicate, a
typed refusal: an idempotency conflict, an unknown target, a sender the calling node does not
host); a frame that does not decode ends the stream with ``INVALID_ARGUMENT``; a stream without
the cluster token is refused ``UNAUTHENTICATED``.

Against small gRPC servers of the test's own on loopback, the sending side (``MessageLink``,
``PeerPool``): a stream that ends under a message fails it ``PEER_UNAVAILABLE`` and the next
message opens a new stream; a message past its deadline is ``DEADLINE_EXCEEDED``; a node that
does not serve the stream (an older release) gets the message by ``SendMessage``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    ActivationId,
    AgentRef,
    DeadlineExceeded,
    IdempotencyConflict,
    NodeId,
    PeerUnavailable,
    Rejected,
    RejectionReason,
    SessionId,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader
from dsh_mesh.transport import PeerPool
from dsh_mesh.transport._link import LinkUnsupported, MessageLink
from dsh_mesh.transport._status import error_from_refusal
from tests.integration.mesh_client import live_ref, messages, started_child

METHOD = "/dsh.mesh.peer.v1.MeshPeer/SendMessages"


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:CRASH"
    ) as running:
        yield running


def carried(
    serial: int, sender: AgentRef, target: str, text: str, key: str
) -> peer_pb2.CarriedMessage:
    return peer_pb2.CarriedMessage(
        id=serial,
        request=mesh_pb2.SendMessageRequest(
            sender=mesh_pb2.AgentRef(
                session_id=sender.session_id, activation_id=sender.activation_id
            ),
            agent_id=target,
            message=text,
            idempotency_key=key,
        ),
        hops=1,
        timeout_ms=30_000,
    )


async def exchange(
    call: Any, *frames: list[peer_pb2.CarriedMessage]
) -> list[dict[int, peer_pb2.CarriedAnswer]]:
    """Write each frame and collect every answer to it before the next; the answers by id."""
    got: list[dict[int, peer_pb2.CarriedAnswer]] = []
    for frame in frames:
        await call.write(peer_pb2.SendMessagesRequest(messages=frame))
        answers: dict[int, peer_pb2.CarriedAnswer] = {}
        async with asyncio.timeout(30):
            while len(answers) < len(frame):
                response = await call.read()
                assert response is not grpc.aio.EOF
                for answer in response.answers:
                    assert answer.id not in answers, "a message answered twice"
                    answers[answer.id] = answer
        assert set(answers) == {m.id for m in frame}
        got.append(answers)
    return got


def refused(answer: peer_pb2.CarriedAnswer) -> Exception:
    assert answer.WhichOneof("outcome") == "refused"
    return error_from_refusal(answer.refused)


async def test_each_carried_message_is_answered_once_as_send_message_would(
    cluster: LocalCluster,
) -> None:
    async with MeshReader(cluster.settings) as reader:
        root, child = await started_child(cluster, reader)
        sender, root_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
        before = messages(await reader.transcript(child))
        address = cluster[child_host].address
        assert address is not None
        key = secrets.token_hex(8)
        async with grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.MeshPeerStub(channel).SendMessages(
                metadata=cluster.metadata(root_host)
            )
            first, second = await exchange(
                call,
                [
                    carried(1, sender, child, "Carried.", key),
                    carried(2, sender, "s-" + "0" * 24, "Nobody.", secrets.token_hex(8)),
                ],
                [
                    carried(3, sender, child, "Carried.", key),  # the same send again
                    carried(4, sender, child, "Other text, same key.", key),
                ],
            )
            call.cancel()
        assert first[1].WhichOneof("outcome") == "accepted"
        assert not first[1].accepted.duplicate
        unknown = refused(first[2])
        assert isinstance(unknown, Rejected)
        assert unknown.reason is RejectionReason.UNKNOWN_TARGET
        assert second[3].accepted.duplicate
        assert second[3].accepted.accepted_seq == first[1].accepted.accepted_seq
        assert isinstance(refused(second[4]), IdempotencyConflict)
        after = messages(await reader.transcript(child))
        assert [m.content for m in after[len(before) :]] == ["Carried."]


async def test_a_sender_the_calling_node_does_not_host_is_forged(cluster: LocalCluster) -> None:
    async with MeshReader(cluster.settings) as reader:
        root, child = await started_child(cluster, reader)
        sender, root_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
    impostor = next(n.node_id for n in cluster if n.node_id != root_host)
    address = cluster[child_host].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        call = peer_pb2_grpc.MeshPeerStub(channel).SendMessages(metadata=cluster.metadata(impostor))
        [answers] = await exchange(call, [carried(7, sender, child, "Hi.", secrets.token_hex(8))])
        call.cancel()
    forged = refused(answers[7])
    assert isinstance(forged, Rejected)
    assert forged.reason is RejectionReason.FORGED_SENDER


async def test_a_frame_that_does_not_decode_ends_the_stream_invalid_argument(
    cluster: LocalCluster,
) -> None:
    address = cluster["node-a"].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        raw = channel.stream_stream(
            METHOD,
            request_serializer=lambda data: data,
            response_deserializer=peer_pb2.SendMessagesResponse.FromString,
        )
        call = raw(metadata=cluster.metadata("node-b"))
        await call.write(b"\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(30):
                await call.read()
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_a_stream_without_the_cluster_token_is_unauthenticated(
    cluster: LocalCluster,
) -> None:
    address = cluster["node-a"].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        call = peer_pb2_grpc.MeshPeerStub(channel).SendMessages(metadata=(("x-dsh-node", "x"),))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(30):
                await call.read()
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


# -- the sending side, against servers of the test's own ----------------------------------


class _Peer(peer_pb2_grpc.MeshPeerServicer):
    """With ``end_first``, its first stream ends under the first message; otherwise (and on
    every later stream) it answers each message at once, or never with ``silent``."""

    def __init__(self, *, end_first: bool = False, silent: bool = False) -> None:
        self.streams = 0
        self.end_first = end_first
        self.silent = silent

    async def SendMessages(
        self, requests: AsyncIterator[peer_pb2.SendMessagesRequest], context: Any
    ) -> AsyncIterator[peer_pb2.SendMessagesResponse]:
        self.streams += 1
        async for frame in requests:
            if self.end_first and self.streams == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            if self.silent:
                continue
            yield peer_pb2.SendMessagesResponse(
                answers=[
                    peer_pb2.CarriedAnswer(
                        id=m.id, accepted=mesh_pb2.SendMessageResponse(accepted_seq=m.id)
                    )
                    for m in frame.messages
                ]
            )


class _OldNode(mesh_pb2_grpc.AgentMeshServicer):
    """A node of an older release: ``SendMessage`` only."""

    async def SendMessage(
        self, request: mesh_pb2.SendMessageRequest, context: Any
    ) -> mesh_pb2.SendMessageResponse:
        return mesh_pb2.SendMessageResponse(
            accepted_seq=41, target_activation_id="a-1", delivery=mesh_pb2.DELIVERY_STEERED
        )


async def _serving(register: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _request(text: str = "hi") -> mesh_pb2.SendMessageRequest:
    return mesh_pb2.SendMessageRequest(
        sender=mesh_pb2.AgentRef(session_id="s-1", activation_id="a-1"),
        agent_id="s-2",
        message=text,
        idempotency_key=secrets.token_hex(8),
    )


@asynccontextmanager
async def linked(peer: _Peer) -> AsyncIterator[MessageLink]:
    """A link to a server of ``peer``'s on loopback; closes both after the block."""
    server, address = await _serving(
        lambda s: peer_pb2_grpc.add_MeshPeerServicer_to_server(peer, s)
    )
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = peer_pb2_grpc.MeshPeerStub(channel)
            link = MessageLink(lambda: stub.SendMessages(), node="peer")
            try:
                yield link
            finally:
                await link.aclose()
    finally:
        await server.stop(None)


async def test_a_stream_that_ends_under_a_message_fails_it_and_the_next_opens_another() -> None:
    peer = _Peer(end_first=True)
    async with linked(peer) as link:
        wait = timedelta(seconds=10)
        with pytest.raises(PeerUnavailable):
            await link.send(_request(), hops=1, deadline=wait)
        answers = await asyncio.gather(
            *(link.send(_request(), hops=1, deadline=wait) for _ in range(50))
        )
        assert sorted(a.accepted_seq for a in answers) == list(range(2, 52))
        assert peer.streams == 2


async def test_big_messages_sent_together_go_in_frames_the_called_node_takes() -> None:
    peer = _Peer()
    async with linked(peer) as link:
        big = "x" * 250_000  # 30 of them: 7.5 MB, past gRPC's 4 MiB for one frame
        answers = await asyncio.gather(
            *(link.send(_request(big), hops=1, deadline=timedelta(seconds=30)) for _ in range(30))
        )
        assert len(answers) == 30
        assert peer.streams == 1
        await link.aclose()
        with pytest.raises(PeerUnavailable):  # a closed link carries nothing more
            await link.send(_request(), hops=1, deadline=timedelta(seconds=1))


async def test_a_message_unanswered_past_its_deadline_is_deadline_exceeded() -> None:
    async with linked(_Peer(silent=True)) as link:
        with pytest.raises(DeadlineExceeded):
            await link.send(_request(), hops=1, deadline=timedelta(milliseconds=200))


async def test_a_node_without_the_stream_gets_messages_by_send_message() -> None:
    server, address = await _serving(
        lambda s: mesh_pb2_grpc.add_AgentMeshServicer_to_server(_OldNode(), s)
    )
    try:
        async with PeerPool(
            node_id=NodeId("node-a"), credential=None, address_of=lambda _: address
        ) as pool:
            for _ in range(2):
                delivery = await pool.hand_on_message(
                    NodeId("old"),
                    AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1")),
                    SessionId("s-2"),
                    "hi",
                    idempotency_key="k",
                    hops=1,
                )
                assert delivery.accepted_seq == 41
            channel = pool.channel(NodeId("old"))
            stub = peer_pb2_grpc.MeshPeerStub(channel)
            probe = MessageLink(lambda: stub.SendMessages(), node="old")
            with pytest.raises(LinkUnsupported):
                await probe.send(_request(), hops=1, deadline=timedelta(seconds=10))
            assert probe.unsupported
            await probe.aclose()
    finally:
        await server.stop(None)
