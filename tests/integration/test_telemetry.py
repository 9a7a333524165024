"""One trace across the mesh, against a real OTLP receiver, real etcd and three node processes:
a lead's tool call sends to its absent child, which is cold-resumed on another node."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from dsh_mesh.core import CompactionEntry, SessionId, SettlementNoticeEntry, TurnStartedEntry
from dsh_mesh.testing import (
    CollectedSpan,
    EtcdAddress,
    LocalCluster,
    MeshReader,
    OtlpReceiver,
    create_root,
    otel_env,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"


def documented_spans() -> dict[str, tuple[set[str], set[str]]]:
    """span-name pattern -> (kinds, attributes) from the table in docs/telemetry.md."""
    rows: dict[str, tuple[set[str], set[str]]] = {}
    in_spans = False
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            in_spans = line.strip() == "### Spans"
        row = re.match(r"\| `([^`]+)` \| ([A-Z, ]+) \| (.*) \|$", line)
        if in_spans and row:
            kinds = {k.strip() for k in row.group(2).split(",")}
            attributes = set(re.findall(r"`([a-z_.]+)`", row.group(3)))
            rows[row.group(1)] = (kinds, attributes)
    return rows


def documented_row(name: str) -> tuple[set[str], set[str]] | None:
    for pattern, row in documented_spans().items():
        regex = "^" + re.sub(r"\\\{[a-z_]+\\\}", ".+", re.escape(pattern)) + "$"
        if re.match(regex, name):
            return row
    return None


def one(
    spans: list[CollectedSpan], name: str, *, node: str | None = None, kind: str | None = None
) -> CollectedSpan:
    found = [
        s
        for s in spans
        if s.name == name
        and (node is None or s.resource.get("dsh.node.id") == node)
        and (kind is None or s.kind == kind)
    ]
    assert len(found) == 1, (name, node, [(s.name, s.kind, s.attributes) for s in found])
    return found[0]


async def test_one_trace_follows_a_message_across_nodes_and_into_a_cold_resumed_step(
    etcd: EtcdAddress,
) -> None:
    async with OtlpReceiver() as receiver:
        with LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario="tests.integration.scenarios:RESUMED",
            env=otel_env(receiver.endpoint),
        ) as cluster:
            async with MeshReader(cluster.settings) as reader:
                root = SessionId(await create_root(cluster, on="node-a", task="Delegate."))

                async def resumed_child_consumed() -> bool:
                    records = await reader.transcript(root)
                    return sum(isinstance(r.entry, SettlementNoticeEntry) for r in records) == 2

                await reader.wait_for(
                    resumed_child_consumed, lambda done: done, what="the resumed child settled"
                )
                child = next(h.session_id for h in await reader.sessions() if h.session_id != root)
                child_records = await reader.transcript(child)

            def arrived(r: OtlpReceiver) -> bool:
                steps = [
                    s
                    for s in r.spans("dsh.step")
                    if s.attributes.get("dsh.session.id") == child and s.links
                ]
                return bool(steps) and (r.latest("dsh.cold_resumes") or 0) >= 2

            await receiver.wait_for(arrived, within=30, what="the child's linked step")
            await asyncio.to_thread(cluster.close)  # nodes flush their telemetry on the way out
            spans = receiver.spans()

            # The lead's tool call and everything the send did, across processes: one trace.
            tool = one(spans, "execute_tool send_message", node="node-a")
            trace = receiver.traces()[tool.trace_id]
            client = one(trace, "/dsh.mesh.v1.AgentMesh/SendMessage", kind="CLIENT")
            assert client.kind == "CLIENT"
            server = one(trace, "/dsh.mesh.v1.AgentMesh/SendMessage", kind="SERVER")
            assert server.kind == "SERVER" and server.parent_span_id == client.span_id
            target_node = server.resource["dsh.node.id"]
            assert target_node != "node-a"
            # The cold resume the send made, in the same trace. A resume that raced the child's
            # own release of its last activation is tried again (TARGET_ELSEWHERE, then won):
            # both tries are in the trace, each of the child.
            resumes = [s for s in trace if s.name == "dsh.cold_resume"]
            assert resumes and all(s.attributes["dsh.session.id"] == child for s in resumes)
            assert any(s.resource["dsh.node.id"] == target_node for s in resumes)
            assert any(
                s.name == "dsh.etcd.activate" and s.attributes.get("dsh.activation.won") is True
                for s in trace
            )
            appends = [s for s in trace if s.name == "dsh.log.append"]
            assert any(s.resource["dsh.node.id"] == target_node for s in appends)
            decisions = {
                s.attributes.get("dsh.authorize.decision")
                for s in trace
                if s.name == "dsh.authorize"
            }
            assert decisions == {"accepted"}

            # The step that consumed the message, in another trace on the target node, links
            # back to the sender's span.
            consuming = [
                s
                for s in spans
                if s.name == "dsh.step"
                and s.attributes.get("dsh.session.id") == child
                and (tool.trace_id, tool.span_id) in {(t, i) for t, i, _ in s.links}
            ]
            assert len(consuming) == 1
            assert consuming[0].resource["dsh.node.id"] == target_node
            assert consuming[0].trace_id != tool.trace_id

            # The lead's step that read the first settlement notice links to the child's
            # final turn (on the node that hosted it first).
            child_turns = {
                (s.trace_id, s.span_id): s
                for s in spans
                if s.name == "dsh.turn" and s.attributes.get("dsh.session.id") == child
            }
            lead_steps = [
                s
                for s in spans
                if s.name == "dsh.step" and s.attributes.get("dsh.session.id") == root
            ]
            linked = {(t, i) for s in lead_steps for t, i, _ in s.links}
            assert linked & set(child_turns)
            # Each turn's start names its span: the web view links a turn to its trace.
            started = [r.entry for r in child_records if isinstance(r.entry, TurnStartedEntry)]
            assert started
            assert {tuple(t.trace.split("-")[1:3]) for t in started} <= set(child_turns)

            # Names and key attributes are the documented ones.
            for span in spans:
                if span.name.startswith("/grpc."):
                    continue
                row = documented_row(span.name)
                assert row is not None, f"undocumented span {span.name}"
                kinds, attributes = row
                assert span.kind in kinds, (span.name, span.kind)
                ours = {k for k in span.attributes if k.startswith(("dsh.", "gen_ai.", "rpc."))}
                assert ours <= attributes, (span.name, ours - attributes)
            model = next(s for s in spans if s.name.startswith("chat "))
            assert model.attributes["gen_ai.request.model"] in {"lead", "brief"}
            assert "gen_ai.usage.input_tokens" in model.attributes

            # Metrics: one message accepted (it cold-resumed the child); two cold resumes (the
            # remote spawn and the resume); both settlements completed.
            assert receiver.latest("dsh.messages.accepted") == 1
            assert receiver.latest("dsh.messages.accepted", **{"dsh.delivery": "cold-resumed"}) == 1
            assert receiver.latest("dsh.cold_resumes") == 2
            assert receiver.latest("dsh.settlements", **{"dsh.outcome": "completed"}) == 2
            assert (receiver.latest("dsh.send_message.duration") or 0) >= 1


async def test_a_compaction_is_traced_within_its_step_with_its_summary_call(
    etcd: EtcdAddress,
) -> None:
    async with OtlpReceiver() as receiver:
        with LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario="tests.integration.scenarios:COMPACTING",
            nodes=("node-a",),
            env=otel_env(receiver.endpoint),
        ) as cluster:
            root = SessionId(
                await create_root(cluster, on="node-a", task="Read the manual.", preset="reader")
            )
            async with MeshReader(cluster.settings) as reader:
                records = await reader.wait_for(
                    lambda: reader.transcript(root),
                    lambda rs: any(isinstance(r.entry, CompactionEntry) for r in rs),
                    what="a compaction",
                )
            await asyncio.to_thread(cluster.close)  # nodes flush their telemetry on the way out
            spans = receiver.spans()

    compactions = [r for r in records if isinstance(r.entry, CompactionEntry)]
    traced = [s for s in spans if s.name == "dsh.context.compact"]
    assert len(traced) >= len(compactions)
    first = next(
        s for s in traced if s.attributes["dsh.context.compaction_seq"] == compactions[0].seq
    )
    assert first.attributes["dsh.session.id"] == root
    assert isinstance(compactions[0].entry, CompactionEntry)
    assert first.attributes["dsh.context.through_seq"] == compactions[0].entry.through_seq
    assert "reached" in str(first.attributes["dsh.context.reason"])
    # The summary call is its child (as is the compaction's append); it is the step's child.
    [summary_call] = [
        s for s in spans if s.parent_span_id == first.span_id and s.name.startswith("chat ")
    ]
    assert summary_call.name == "chat reader"
    assert summary_call.attributes["dsh.model_call.purpose"] == "compaction"
    step = next(s for s in spans if s.span_id == first.parent_span_id)
    assert step.name == "dsh.step"
    for span in (first, summary_call):
        row = documented_row(span.name)
        assert row is not None, f"undocumented span {span.name}"
        ours = {k for k in span.attributes if k.startswith(("dsh.", "gen_ai."))}
        assert ours <= row[1], (span.name, ours - row[1])
