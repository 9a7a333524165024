"""A compacted agent cold-resumed on another node process after its host is SIGKILLed: it
resumes from its latest compaction and what follows it (docs/context.md), finishes the turn its
host died in as lost, and goes on from its summary without repeating a step."""

from __future__ import annotations

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AssistantStepEntry,
    CompactionEntry,
    Record,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root
from tests.integration.mesh_client import prompt_until_accepted


def of(records: list[Record], kind: type) -> list[Record]:
    return [r for r in records if isinstance(r.entry, kind)]


async def test_a_compacted_agent_resumes_elsewhere_from_its_summary(etcd: EtcdAddress) -> None:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:COMPACTING",
        nodes=("node-a", "node-b"),
        placement="local",
    ) as cluster:
        root = await create_root(cluster, on="node-a", task="Read the manual.", preset="reader")
        async with MeshReader(cluster.settings) as reader:
            # Every page read (and compacted along the way); the eleventh step stalls.
            await reader.wait_for(
                lambda: reader.transcript(root),
                lambda records: len(of(records, ToolResultEntry)) == 10,
                what="ten pages read",
            )
            cluster["node-a"].kill()
            # Refused as retryable until node-a's lease, and with it the activation, is gone.
            await prompt_until_accepted(cluster, "node-b", root)

            def answered(records: list[Record]) -> bool:
                ends = [r.entry for r in of(records, TurnEndedEntry)]
                return len(ends) == 2

            records = await reader.wait_for(
                lambda: reader.transcript(root), answered, what="the prompt answered"
            )
        # The whole transcript, compactions and clearings included, over the wire.
        async with cluster.channel("node-b") as channel:
            page = await mesh_pb2_grpc.MeshControlStub(channel).GetSession(
                mesh_pb2.GetSessionRequest(session_id=root, page_size=1000),
                metadata=cluster.metadata("tester"),
                timeout=30,
            )
    wire = [e for e in page.transcript]
    assert [e.seq for e in wire] == [r.seq for r in records]
    compacted = [e.compaction for e in wire if e.WhichOneof("body") == "compaction"]
    assert compacted and all(
        c.summary and c.through_seq >= c.from_seq >= 1 and c.task == "Read the manual."
        for c in compacted
    )
    assert all(c.model == "reader" and c.usage.input_tokens > 0 for c in compacted)
    cleared = [
        e.tool_outputs_cleared for e in wire if e.WhichOneof("body") == "tool_outputs_cleared"
    ]
    assert cleared and all(list(c.seqs) for c in cleared)

    ended = of(records, TurnEndedEntry)
    lost, answered_turn = (r.entry for r in ended)
    assert isinstance(lost, TurnEndedEntry) and lost.outcome is TurnOutcome.LOST
    # The resume started from the last compaction node-a wrote (the resumed turn may compact
    # again on node-b).
    before_the_kill = [r.entry for r in of(records, CompactionEntry) if r.seq < ended[0].seq]
    assert before_the_kill, "the reader never compacted before its host was killed"
    last = before_the_kill[-1]
    assert isinstance(last, CompactionEntry)
    assert last.open_turn is not None  # it compacted mid-turn: the resume knows that turn
    assert lost.turn_id == last.open_turn.turn_id
    assert isinstance(answered_turn, TurnEndedEntry)
    assert answered_turn.outcome is TurnOutcome.COMPLETED, answered_turn.detail
    # No read ran twice: the summary told the resumed program how far it had got.
    assert len(of(records, ToolResultEntry)) == 10
    final = [r.entry for r in of(records, AssistantStepEntry)][-1]
    assert isinstance(final, AssistantStepEntry) and final.text == "Resumed from my summary."
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
