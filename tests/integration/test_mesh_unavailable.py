"""The retryable and deadline refusals over the wire: a peer that is gone, etcd that is gone, a
node that fenced itself, a caller's deadline, and a control call naming no session."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    DeadlineExceeded,
    MeshError,
    NodeFenced,
    PeerUnavailable,
    RegistryUnavailable,
    SessionUnknown,
)
from dsh_mesh.testing import EtcdAddress, EtcdServer, LocalCluster, MeshReader
from dsh_mesh.transport import error_from_rpc
from tests.integration.mesh_client import live_ref, send_as, started_child


@pytest.fixture
def crash_cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:CRASH"
    ) as cluster:
        yield cluster


async def test_a_send_to_a_child_whose_host_just_died_is_peer_unavailable(
    crash_cluster: LocalCluster,
) -> None:
    async with MeshReader(crash_cluster.settings) as reader:
        root, child = await started_child(crash_cluster, reader)
        _, child_host = await live_ref(reader, child)
        crash_cluster[child_host].kill()  # its activation stays until the lease expires
        parent, root_host = await live_ref(reader, root)
        before = await reader.transcript(child)
        with pytest.raises(PeerUnavailable) as caught:
            await send_as(
                crash_cluster, via=root_host, caller=root_host, sender=parent, target=child,
                message="Are you there?",
            )  # fmt: skip
        assert caught.value.retryable
        assert await reader.transcript(child) == before


async def test_a_caller_deadline_before_acceptance_is_deadline_exceeded(
    crash_cluster: LocalCluster,
) -> None:
    async with MeshReader(crash_cluster.settings) as reader:
        root, child = await started_child(crash_cluster, reader)
        parent, root_host = await live_ref(reader, root)
    address = crash_cluster[root_host].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.AgentMeshStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=mesh_pb2.AgentRef(
                        session_id=parent.session_id, activation_id=parent.activation_id
                    ),
                    agent_id=child,
                    message="Too late.",
                    idempotency_key=secrets.token_hex(8),
                ),
                metadata=crash_cluster.metadata(root_host),
                timeout=0.000_001,
            )
    error = error_from_rpc(caught.value)
    assert isinstance(error, DeadlineExceeded) and not error.retryable


async def test_a_prompt_for_no_session_is_unknown_session(crash_cluster: LocalCluster) -> None:
    address = crash_cluster["node-a"].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SubmitPrompt(
                mesh_pb2.SubmitPromptRequest(
                    session_id="s-nobody", text="Hello?", idempotency_key="p-1"
                ),
                metadata=crash_cluster.metadata("a-human"),
                timeout=10,
            )
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert isinstance(error_from_rpc(caught.value), SessionUnknown)


async def test_etcd_gone_is_registry_unavailable_then_node_fenced_then_service_resumes(
    etcd_server: EtcdServer,
) -> None:
    with LocalCluster(
        etcd_endpoint=etcd_server.endpoint, scenario="tests.integration.scenarios:CRASH"
    ) as cluster:
        async with MeshReader(cluster.settings) as reader:
            root, child = await started_child(cluster, reader)
            parent, root_host = await live_ref(reader, root)
            etcd_server.kill()

            async def refusal() -> MeshError:
                try:
                    await send_as(
                        cluster, via=root_host, caller=root_host, sender=parent, target=child,
                        message="Is anyone durable?", key="outage-1",
                    )  # fmt: skip
                except MeshError as error:
                    return error
                raise AssertionError("a send was accepted while etcd was down")

            first = await refusal()
            assert isinstance(first, RegistryUnavailable | NodeFenced), first
            assert first.retryable
            # Once its lease can no longer be confirmed, the node fences itself.
            fenced = await reader.wait_for(
                refusal, lambda e: isinstance(e, NodeFenced), what="the node fencing itself"
            )
            assert isinstance(fenced, NodeFenced) and fenced.retryable
            etcd_server.restart()
            await reader.wait_for(
                lambda: _health(cluster, root_host),
                lambda status: status == 1,
                what="the node serving again after etcd returned",
            )
        assert "lost its lease: fenced" in cluster[root_host].log()


async def _health(cluster: LocalCluster, node: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = cluster[node].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)
