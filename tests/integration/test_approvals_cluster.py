"""A call waiting for approval survives its host (docs/approvals.md): SIGKILL the node while the
request is pending, approve through another node process, and the call runs once, on the node
that resumes the agent. Every decision is in the transcript, over the wire."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    ApprovalRequestEntry,
    ApprovalStale,
    Rejected,
    SessionId,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV, read_probe_log
from dsh_mesh.transport import error_from_rpc
from tests.integration.scenarios import PROBE_PRESETS


@pytest.fixture
def gated(etcd: EtcdAddress, tmp_path: Path) -> Iterator[tuple[LocalCluster, Path]]:
    presets = tmp_path / "presets.toml"
    presets.write_text(PROBE_PRESETS)
    log, gate = tmp_path / "probe.log", tmp_path / "probe.gate"
    gate.touch()  # a probe returns at once
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PROBE",
        presets_file=presets,
        nodes=("node-a", "node-b"),
        placement="local",
        env={LOG_ENV: str(log), GATE_ENV: str(gate)},
    ) as cluster:
        yield cluster, log


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


async def test_a_pending_approval_survives_the_sigkill_of_its_host_and_runs_once(
    gated: tuple[LocalCluster, Path],
) -> None:
    cluster, log = gated
    root = await create_root(cluster, on="node-a", task="Probe, once allowed.", preset="gated")
    async with MeshReader(cluster.settings) as reader:
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: any(isinstance(r.entry, TurnEndedEntry) for r in rs),
            what="the turn stopped at the call",
        )
        [request] = [r.entry for r in records if isinstance(r.entry, ApprovalRequestEntry)]
        assert isinstance(request, ApprovalRequestEntry) and request.tool == "probe_unsafe"
        assert read_probe_log(log) == []

        cluster["node-a"].kill()
        decision = mesh_pb2.ResolveApprovalRequest(
            session_id=root,
            call_id=request.call_id,
            decision=mesh_pb2.APPROVAL_DECISION_ALLOW,
            request_digest=request.digest,
            reason="checked the plan",
        )
        accepted = await resolve_until_accepted(cluster, "node-b", decision)
        assert accepted.decided_by == "operator" and not accepted.duplicate

        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the turn gone on from the approved call, ended",
        )
        again = await resolve_until_accepted(cluster, "node-b", decision)
        assert again.duplicate and again.accepted_seq == accepted.accepted_seq
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await deny(cluster, "node-b", root, request)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert isinstance(error_from_rpc(refused.value), ApprovalStale)
        async with cluster.channel("node-b") as channel:
            page = await mesh_pb2_grpc.MeshControlStub(channel).GetSession(
                mesh_pb2.GetSessionRequest(session_id=root, page_size=1000),
                metadata=cluster.metadata("tester"),
                timeout=30,
            )

    [run] = read_probe_log(log)  # once, by the node that resumed the agent
    assert run.session == root
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended == [TurnOutcome.AWAITING_APPROVAL, TurnOutcome.COMPLETED]
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert not result.is_error and result.content.startswith("probe_unsafe ran")
    kinds = [e.WhichOneof("body") for e in page.transcript]
    wire_request = page.transcript[kinds.index("approval_request")].approval_request
    assert wire_request.request_digest == request.digest
    assert wire_request.HasField("expires_at")
    decided = page.transcript[kinds.index("approval_decision")]
    assert decided.approval_decision.decision == mesh_pb2.APPROVAL_DECISION_ALLOW
    assert decided.approval_decision.by == "operator"
    assert decided.approval_decision.reason == "checked the plan"
    assert decided.HasField("recorded_at")
    assert kinds.count("approval_decision") == 1


async def deny(
    cluster: LocalCluster, node: str, root: SessionId, request: ApprovalRequestEntry
) -> None:
    async with cluster.channel(node) as channel:
        await mesh_pb2_grpc.MeshControlStub(channel).ResolveApproval(
            mesh_pb2.ResolveApprovalRequest(
                session_id=root,
                call_id=request.call_id,
                decision=mesh_pb2.APPROVAL_DECISION_DENY,
                request_digest=request.digest,
            ),
            metadata=cluster.metadata("tester"),
            timeout=30,
        )
