"""A call waiting for approval survives its host (docs/approvals.md): SIGKILL the node while the
request is pending, approve through another node process, and the call runs once, on the node
that resumes the agent. Every decision is in the transcript, over the wire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    SessionId,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV, read_probe_log
from dsh_mesh.transport import error_from_rpc
from tests.integration.mesh_client import (
    list_approvals,
    resolve_until_accepted,
    stopped_at_the_call,
)
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
        env={LOG_ENV: str(log), GATE_ENV: str(gate), "DSH_APPROVAL_SWEEP_INTERVAL": "0.3"},
    ) as cluster:
        yield cluster, log


async def test_a_pending_approval_survives_the_sigkill_of_its_host_and_runs_once(
    gated: tuple[LocalCluster, Path],
) -> None:
    cluster, log = gated
    root = await create_root(cluster, on="node-a", task="Probe, once allowed.", preset="gated")
    async with MeshReader(cluster.settings) as reader:
        records = await stopped_at_the_call(reader, root)
        [request] = [r.entry for r in records if isinstance(r.entry, ApprovalRequestEntry)]
        assert isinstance(request, ApprovalRequestEntry) and request.tool == "probe_unsafe"
        assert read_probe_log(log) == []
        [listed] = (await list_approvals(cluster, "node-a", root)).approvals
        assert (listed.session_id, listed.request.call_id) == (root, request.call_id)
        assert listed.request.request_digest == request.digest and listed.seq > 0

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
        assert not (await list_approvals(cluster, "node-b", root)).approvals
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


def cli(
    cluster: LocalCluster, *args: str, node: str = "node-a"
) -> subprocess.CompletedProcess[str]:
    """The real ``dsh-mesh`` command against ``node``, as a person runs it."""
    address = cluster[node].address
    assert address is not None
    env = {**os.environ, "DSH_NODE": address, "DSH_CLUSTER_TOKEN": cluster.settings.cluster_token}
    return subprocess.run(
        [sys.executable, "-m", "dsh_mesh.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_command_lists_a_trees_waiting_calls_and_denies_one(
    gated: tuple[LocalCluster, Path],
) -> None:
    cluster, log = gated
    root = await create_root(cluster, on="node-a", task="Probe, once allowed.", preset="gated")
    async with MeshReader(cluster.settings) as reader:
        await stopped_at_the_call(reader, root)
        listed = cli(cluster, "approvals", root, "--json")
        assert listed.returncode == 0, listed.stderr
        [waiting] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert waiting["session_id"] == root and waiting["request"]["tool"] == "probe_unsafe"
        call = waiting["request"]["call_id"]
        # `ls` says what the web view says of it (issue 36): its call waits for a person.
        shown = cli(cluster, "ls", "--root", root)
        assert shown.returncode == 0, shown.stderr
        [row] = [line.split() for line in shown.stdout.splitlines() if line.startswith(root)]
        assert row[4] == "awaiting-approval", shown.stdout

        denied = cli(cluster, "deny", root, call, "--reason", "not today")
        assert denied.returncode == 0, denied.stderr
        assert f"denied call {call} of {root} as operator" in denied.stdout
        assert waiting["request"]["request_digest"] in denied.stderr  # what it decided on
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the turn gone on from the denied call",
        )
        # Nothing waits any more: the same decision again is the first one's duplicate, and
        # another is refused as stale (docs/approvals.md), as the mesh says, not "no call".
        again = cli(cluster, "deny", root, call, "--reason", "not today")
        assert again.returncode == 0, again.stderr
        assert "already decided so: nothing changed" in again.stdout
        other = cli(cluster, "approve", root, call)
        assert other.returncode != 0 and "APPROVAL_STALE" in other.stderr, other.stderr
        never = cli(cluster, "approve", root, "no-such-call")
        assert never.returncode != 0 and "never asked approval" in never.stderr
        assert cli(cluster, "approvals", root, "--json").stdout.strip() == ""
        after = cli(cluster, "ls", "--root", root, "--json")
        [summary] = [json.loads(line) for line in after.stdout.splitlines()]
        assert summary["awaiting_approval"] is False
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert result.is_error and result.content.endswith("by operator: not today")
    assert read_probe_log(log) == []


async def test_a_request_of_an_agent_whose_host_died_expires_on_another_node(
    gated: tuple[LocalCluster, Path],
) -> None:
    """No message comes: another node finds the expired request in the log store's index,
    resumes the agent, and the agent answers it as denied and goes on."""
    cluster, log = gated
    root = await create_root(cluster, on="node-a", task="Probe, briefly.", preset="gated-brief")
    async with MeshReader(cluster.settings) as reader:
        await stopped_at_the_call(reader, root)
        cluster["node-a"].kill()
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the expired request answered and the turn gone on",
        )
    [decided] = [r.entry for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    assert decided.by == "dsh-mesh" and "expired" in decided.reason
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert result.is_error and "expired" in result.content
    started = [r.entry for r in records if isinstance(r.entry, TurnStartedEntry)]
    assert started[-1].node_id == "node-b"  # the one node left
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended == [TurnOutcome.AWAITING_APPROVAL, TurnOutcome.COMPLETED]
    assert read_probe_log(log) == []


async def test_a_stop_denies_the_request_of_an_agent_whose_host_died(
    gated: tuple[LocalCluster, Path],
) -> None:
    cluster, log = gated
    root = await create_root(cluster, on="node-a", task="Probe, once allowed.", preset="gated")
    async with MeshReader(cluster.settings) as reader:
        await stopped_at_the_call(reader, root)
        cluster["node-a"].kill()
        await reader.wait_for(
            lambda: reader.activation(root), lambda a: a is None, what="node-a's lease gone"
        )
        stopped = cli(
            cluster, "stop", root, "--tree", "--close", "--reason", "incident", node="node-b"
        )
        assert stopped.returncode == 0, stopped.stderr
        records = await reader.transcript(root)
    [decided] = [r.entry for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    assert decided.by == "dsh-mesh" and "incident" in decided.reason
    assert not (await list_approvals(cluster, "node-b", root)).approvals
    assert read_probe_log(log) == []
