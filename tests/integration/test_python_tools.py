"""Python tools on real node processes: a ``[tools]`` module every node imports, and the replay
promise across a host's death. A child's step calls a probe tool (one line per execution in a
shared file) that blocks; the child's host is SIGKILLed mid-call; the parent's next message
cold-resumes the child on another node. A ``replay="safe"`` call runs again there under the same
idempotency key and its result is the real one; an unsafe call is answered "outcome unknown"
and never runs a second time. Either way the call has exactly one result."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AssistantStepEntry,
    SettlementOutcome,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
    replacement_note,
)
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    NodeProcess,
    calls_without_one_answer,
    create_root,
)
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV, read_probe_log
from tests.integration.mesh_client import children_of, live_ref, notices, send_as
from tests.integration.scenarios import PROBE_PRESETS


@pytest.fixture
def probed(etcd: EtcdAddress, tmp_path: Path) -> Iterator[tuple[LocalCluster, Path, Path]]:
    presets = tmp_path / "presets.toml"
    presets.write_text(PROBE_PRESETS)
    log, gate = tmp_path / "probe.log", tmp_path / "probe.gate"
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PROBE",
        presets_file=presets,
        env={LOG_ENV: str(log), GATE_ENV: str(gate)},
    ) as cluster:
        yield cluster, log, gate


@pytest.mark.parametrize("replay", ["safe", "unsafe"])
async def test_a_python_tool_call_survives_the_sigkill_of_its_host(
    probed: tuple[LocalCluster, Path, Path], replay: str
) -> None:
    cluster, log, gate = probed
    name = f"probe_{replay}"
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Delegate.", preset=f"lead-{replay}")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        await reader.wait_for(
            lambda: _async(read_probe_log(log)), bool, what="the probe's first execution"
        )
        _, child_host = await live_ref(reader, child.session_id)
        cluster[child_host].kill()  # the call is running: it waits on its gate
        await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        gate.touch()  # a run from now on returns at once
        parent, root_host = await live_ref(reader, root)
        await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child.session_id,
            message="Carry on.", key="after-kill",
        )  # fmt: skip
        records = await reader.wait_for(
            lambda: reader.transcript(child.session_id),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the lost turn and the resumed one, ended",
        )
    assert calls_without_one_answer(records) == []
    [result] = [
        r.entry for r in records if isinstance(r.entry, ToolResultEntry) and r.entry.name == name
    ]
    runs = read_probe_log(log)
    assert {run.tool for run in runs} == {name}
    assert {run.session for run in runs} == {child.session_id}
    if replay == "safe":
        assert len(runs) == 2, runs  # once on the dead host, once on the resuming one
        assert runs[0].key == runs[1].key and runs[0].pid != runs[1].pid
        assert not result.is_error and result.content == f"{name} ran ({runs[0].key})"
    else:
        assert len(runs) == 1, runs  # never run a second time
        assert result.is_error and json.loads(result.content)["outcome"] == "unknown"
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended == [TurnOutcome.LOST, TurnOutcome.COMPLETED]


async def _async(value: object) -> object:
    return value


async def test_a_tool_that_blocks_past_the_lease_ttl_never_delays_the_lease(
    probed: tuple[LocalCluster, Path, Path],
) -> None:
    """The tool blocks its thread for 10 s with a lease TTL of 2 s: it runs on a worker
    thread, so the node's loop keeps renewing the lease. The child keeps its one activation,
    its call gets its real result, and its parent hears it completed, never lost."""
    cluster, _, _ = probed
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Delegate.", preset="lead-pause")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        at_root = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda r: bool(notices(r)),
            within=40,
            what="the child's settlement notice",
        )
        records = await reader.transcript(child.session_id)
    [notice] = notices(at_root)
    assert notice.outcome is SettlementOutcome.COMPLETED, notice
    assert notice.terminal_output == "Paused."
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert not result.is_error and result.content == "paused 10 s"
    assert result.duration_ms >= 10_000
    turns = [r.entry for r in records if isinstance(r.entry, TurnStartedEntry)]
    assert len(turns) == 1  # one activation ran it all: never fenced, never resumed
    print(f"\n10 s blocking tool, lease TTL 2 s: call ran {result.duration_ms} ms, one turn")


async def test_an_interrupt_ends_a_turn_whose_60_s_tool_is_running(
    probed: tuple[LocalCluster, Path, Path],
) -> None:
    """A root's tool blocks for 60 s; the interrupt cancels the call and ends the turn at once
    (the thread cannot be stopped; the call is answered as cancelled, its effect unknown)."""
    cluster, _, _ = probed
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Get stuck.", preset="stuck")
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: any(isinstance(r.entry, AssistantStepEntry) for r in rs),
            what="the step whose call blocks",
        )
        started = time.monotonic()
        stopped = await interrupt(cluster, root)
        assert stopped.interrupted
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: any(isinstance(r.entry, TurnEndedEntry) for r in rs),
            within=30,
            what="the cancelled turn",
        )
        ended_after = time.monotonic() - started
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert result.is_error and "the call was cancelled" in result.content
    [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended.outcome is TurnOutcome.CANCELLED
    assert ended_after < 30  # long before the tool's 60 s: the turn did not wait for it
    print(f"\ninterrupt with a 60 s tool running: the turn ended {ended_after:.2f} s later")


async def interrupt(cluster: LocalCluster, session: str) -> mesh_pb2.InterruptResponse:
    address = cluster["node-a"].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        response: mesh_pb2.InterruptResponse = await stub.Interrupt(
            mesh_pb2.InterruptRequest(session_id=session),
            metadata=cluster.metadata("a-human"),
            timeout=10,
        )
        return response


async def test_text_that_is_not_valid_unicode_is_stored_valid_and_every_reader_reads_it(
    probed: tuple[LocalCluster, Path, Path],
) -> None:
    """A child's tool returns a lone surrogate and a ``surrogateescape``d byte, and its model's
    reply (its terminal output, quoted in its parent's notice) holds one too. Every node stays
    up, the text is stored valid with a note of the replacements, and both transcripts read over
    ``GetSession`` on every node (they answered UNKNOWN for good before the text boundary)."""
    cluster, _, _ = probed
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Delegate.", preset="lead-garbled")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        at_root = await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="the notice"
        )
        at_child = await reader.transcript(child.session_id)
    [result] = [r.entry for r in at_child if isinstance(r.entry, ToolResultEntry)]
    assert result.content == "caf\ufffd \ufffd end\n" + replacement_note(2)
    [notice] = notices(at_root)
    assert notice.outcome is SettlementOutcome.COMPLETED
    assert notice.terminal_output == "Listed caf\ufffd.\n" + replacement_note(1)
    for node in cluster:
        assert node.running, f"{node.node_id} died"
        for session, expected in (
            (child.session_id, result.content),
            (root, notice.terminal_output),
        ):
            assert expected in await _texts_over_grpc(node, cluster, session), (node, session)


async def _texts_over_grpc(node: NodeProcess, cluster: LocalCluster, session: str) -> list[str]:
    """The tool results' and notices' texts of ``session``, read by ``GetSession`` on ``node``."""
    assert node.address is not None
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        response = await stub.GetSession(
            mesh_pb2.GetSessionRequest(session_id=session),
            metadata=cluster.metadata("a-human"),
            timeout=20,
        )
    return [e.tool_result.content for e in response.transcript if e.HasField("tool_result")] + [
        e.settlement_notice.terminal_output
        for e in response.transcript
        if e.HasField("settlement_notice")
    ]
