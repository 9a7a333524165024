"""``make demo`` runs this: it must keep showing what the mesh promises."""

from __future__ import annotations

from dsh_mesh.core import (
    AgentMessageEntry,
    Record,
    SettlementNoticeEntry,
    SettlementOutcome,
    ToolResultEntry,
    session_usage,
)
from dsh_mesh.demo import DemoRun, print_run, run_cluster_demo
from dsh_mesh.testing import LocalCluster


def _notices(records: list[Record]) -> list[tuple[str, SettlementOutcome]]:
    return [
        (r.entry.child_session, r.entry.outcome)
        for r in records
        if isinstance(r.entry, SettlementNoticeEntry)
    ]


async def test_the_cluster_demo_shows_delivery_both_ways_a_kill_and_a_cold_resume() -> None:
    lines: list[str] = []
    kept: list[list[str]] = []

    async def linger(_cluster: LocalCluster, run: DemoRun) -> None:
        kept.append(list(run.trace))  # what `--keep` prints while the cluster stays up

    run = await run_cluster_demo(say=lines.append, linger=linger)
    # `make demo DEMO_ARGS=--keep` prints the run before the cluster stops: its trace section
    # is there already, the step that consumed the follow-up included.
    [trace] = kept
    assert trace and any(line.startswith("consumed by") for line in trace), trace
    root = run.transcripts[run.root]
    alpha, beta, _gloss = (s for s in run.transcripts if s != run.root)
    # Children live on other nodes than their parent; alpha moved after its host was killed.
    assert run.hosts[run.root] == ["node-a"]
    assert run.hosts[alpha][0] != "node-a" and len(run.hosts[alpha]) == 2
    assert run.killed == run.hosts[alpha][0] != run.hosts[alpha][1]
    # Both directions: the lead's messages in alpha's transcript, alpha's in the lead's.
    assert any(
        isinstance(r.entry, AgentMessageEntry) and r.entry.source.sender_session_id == run.root
        for r in run.transcripts[alpha]
    )
    from_alpha = [
        r.seq
        for r in root
        if isinstance(r.entry, AgentMessageEntry) and r.entry.source.sender_session_id == alpha
    ]
    alpha_notices = [
        (r.seq, r.entry.outcome)
        for r in root
        if isinstance(r.entry, SettlementNoticeEntry) and r.entry.child_session == alpha
    ]
    assert [outcome for _, outcome in alpha_notices] == [
        SettlementOutcome.LOST,
        SettlementOutcome.COMPLETED,
    ]
    assert max(from_alpha) < alpha_notices[-1][0]  # its messages precede its final notice
    assert (beta, SettlementOutcome.COMPLETED) in _notices(root)
    # beta read the docs through the Python tool and through the MCP server its node launched.
    results = {
        r.entry.name: r.entry for r in run.transcripts[beta] if isinstance(r.entry, ToolResultEntry)
    }
    assert not results["read_doc"].is_error
    assert results["read_doc"].content.startswith("# ")  # the doc's title line
    assert not results["docs__search_docs"].is_error
    assert "deadline" in results["docs__search_docs"].content.lower()
    # The sibling send was refused with its reason; the resume was reported as such.
    assert any(
        isinstance(r.entry, ToolResultEntry) and "SIBLING_TARGET" in r.entry.content
        for r in run.transcripts[beta]
    )
    assert any(
        isinstance(r.entry, ToolResultEntry) and "cold-resumed" in r.entry.content for r in root
    )
    assert any(line.startswith("every node stopped and reaped") for line in lines)
    # The trace of the lead's follow-up: sent on node-a, accepted on alpha's first host, and
    # consumed (linked back) on the node that resumed alpha.
    assert run.trace[0].startswith("execute_tool send_message [dsh-mesh-node-a]")
    assert any("/dsh.mesh.v1.AgentMesh/SendMessage" in line for line in run.trace)
    assert any(
        line.startswith(f"consumed by dsh.step [dsh-mesh-{run.hosts[alpha][1]}]")
        for line in run.trace
    )
    # Every agent's usage, read back with GetSession: a settled child's is exactly the sum of
    # its durable steps (the scripted model reports 8 output tokens a call, nothing cached).
    for child in (alpha, beta, _gloss):
        assert run.usage[child] == session_usage(r.entry for r in run.transcripts[child])
        assert run.usage[child].model_calls >= 1
        assert run.usage[child].output_tokens == 8 * run.usage[child].model_calls
    lead = run.usage[run.root]  # the lead may still be answering the last notice
    assert lead.model_calls >= session_usage(r.entry for r in root).model_calls >= 3
    assert lead.input_tokens > 0 and lead.cached_input_tokens == 0
    printed: list[str] = []
    print_run(run, write=printed.append)
    assert any("->" in line for line in printed)
    usage_lines = printed[printed.index("\n=== model usage per agent (GetSession) ===") + 1 :]
    assert usage_lines[0].split()[:3] == ["root", "(lead)", run.root]
    assert f"{lead.model_calls} model calls: " in usage_lines[0]
