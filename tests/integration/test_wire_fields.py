"""Every field ``dsh.mesh.v1`` documents is filled on the wire, read the way a client in any
language reads it: raw generated messages over real gRPC against a real cluster (scenario
EXCHANGE: a lead on node-a, a worker on another node, messages both ways, the worker settles).

The generic check walks every message the control plane returned (GetSession pages, ListAgents,
a tree watch, a refusal's ``Rejection``) and asks, for each message type seen, that each of its
fields was set at least once. A field this scenario cannot set is listed in ``NOT_IN_SCENARIO``
with the reason. Then the fields that once were never filled are checked on every instance.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import status_pb2

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.testing import EtcdAddress, LocalCluster
from dsh_mesh.transport import DETAILS_METADATA_KEY

NOT_IN_SCENARIO: dict[str, str] = {
    "dsh.mesh.v1.SessionHeader.fork_origin": "no fork in EXCHANGE",
    "dsh.mesh.v1.TranscriptEntry.fork_prefix": "no fork in EXCHANGE: test_cli.py (unit) and"
    " test_mesh.py's fork",
    "dsh.mesh.v1.Session.next_page_token": "every page here reaches the end",
    "dsh.mesh.v1.ListAgentsResponse.next_page_token": "two agents fit one page",
    "dsh.mesh.v1.AgentMessageEntry.trace": "tracing is off in the test cluster",
    "dsh.mesh.v1.TurnStartedEntry.trace": "tracing is off in the test cluster",
    "dsh.mesh.v1.SettlementNoticeEntry.detail": "the worker completes (no error to explain)",
    "dsh.mesh.v1.TurnEndedEntry.detail": "every turn completes",
    "dsh.mesh.v1.ToolResultEntry.is_error": "no tool call fails",
    "dsh.mesh.v1.Usage.cached_input_tokens": "the scripted provider has no prompt cache",
    "dsh.mesh.v1.SessionUsage.cached_input_tokens": "the scripted provider has no prompt cache",
    "dsh.mesh.v1.TranscriptEntry.compaction": "no context fills up here: test_context_cluster.py",
    "dsh.mesh.v1.TranscriptEntry.approval_request": "no preset marks a tool here:"
    " test_approvals_cluster.py",
    "dsh.mesh.v1.TranscriptEntry.approval_decision": "no preset marks a tool here:"
    " test_approvals_cluster.py",
    "dsh.mesh.v1.TranscriptEntry.tool_outputs_cleared": "no context fills up here:"
    " test_context_cluster.py",
    "dsh.mesh.v1.SessionEvent.delta": "EXCHANGE's watch asks for no deltas: test_deltas_cluster.py",
    "dsh.mesh.v1.SessionSpec.output_schema_json": "no preset or root names an output schema"
    " here: test_structured_answers_cluster.py",
    "dsh.mesh.v1.SettlementNoticeEntry.output_json": "no output schema here:"
    " test_structured_answers_cluster.py",
    "dsh.mesh.v1.TurnEndedEntry.output_json": "no output schema here:"
    " test_structured_answers_cluster.py",
    "dsh.mesh.v1.TranscriptEntry.answer_rejected": "no output schema here:"
    " test_structured_answers_cluster.py",
}

WATCH_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:EXCHANGE"
    ) as running:
        yield running


def walk(message: Message) -> Iterator[Message]:
    """``message`` and every message nested in it, depth first."""
    yield message
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        values: Iterable[Any] = value if field.is_repeated else (value,)
        for item in values:
            if isinstance(item, Message):
                yield from walk(item)


def never_set(messages: Iterable[Message]) -> list[str]:
    """``<message type>.<field>`` of every ``dsh.mesh.v1`` field that no instance among
    ``messages`` (and everything they nest) set, for each type that occurs at all."""
    fields: dict[str, set[str]] = {}
    seen: dict[str, set[str]] = defaultdict(set)
    for top in messages:
        for message in walk(top):
            descriptor = message.DESCRIPTOR
            fields[descriptor.full_name] = {f.name for f in descriptor.fields}
            seen[descriptor.full_name].update(f.name for f, _ in message.ListFields())
    return sorted(
        f"{name}.{field}"
        for name, names in fields.items()
        if name.startswith("dsh.mesh.v1.")
        for field in names - seen[name]
    )


async def exchange(cluster: LocalCluster) -> tuple[str, list[mesh_pb2.SessionEvent]]:
    """Run the exchange under a tree watch through node-b; return the root and the events up
    to where both directions, the worker's settlement notice at the root and the worker's
    residency (won and released) were seen."""
    metadata = cluster.metadata("wire-test")
    async with cluster.channel("node-a", client="wire-test") as channel:
        control = mesh_pb2_grpc.MeshControlStub(channel)
        created = await control.CreateRootSession(
            mesh_pb2.CreateRootSessionRequest(
                preset="lead",
                node_id="node-a",
                initial_task="Survey etcd leases, with help.",
                request_id=secrets.token_hex(8),
            ),
            metadata=metadata,
            timeout=20,
        )
        await control.SubmitPrompt(
            mesh_pb2.SubmitPromptRequest(
                session_id=created.session_id, text="And report.", idempotency_key="prompt-1"
            ),
            metadata=metadata,
            timeout=20,
        )
    root = created.session_id
    events: list[mesh_pb2.SessionEvent] = []

    def done() -> bool:
        bodies = {
            (e.session_id == root, e.entry.WhichOneof("body"))
            for e in events
            if e.HasField("entry")
        }
        child_came = any(e.HasField("activated") and e.session_id != root for e in events)
        child_left = any(e.HasField("deactivated") and e.session_id != root for e in events)
        return (
            child_came
            and child_left
            and {
                (True, "agent_message"),
                (False, "agent_message"),
                (True, "settlement_notice"),
            }
            <= bodies
        )

    async with cluster.channel("node-b", client="wire-test") as channel:
        stream = mesh_pb2_grpc.MeshControlStub(channel).WatchSession(
            mesh_pb2.WatchSessionRequest(session_id=root, tree=True),
            metadata=metadata,
            timeout=WATCH_TIMEOUT,
        )
        async for event in stream:
            events.append(event)
            if done():
                stream.cancel()
                break
    assert done(), f"the exchange did not complete: {len(events)} events"
    return root, events


async def read_all(cluster: LocalCluster, session: str) -> list[mesh_pb2.Session]:
    """Every page of ``session`` (small pages, so paging is read too)."""
    pages: list[mesh_pb2.Session] = []
    token = ""
    async with cluster.channel("node-b", client="wire-test") as channel:
        control = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            page = await control.GetSession(
                mesh_pb2.GetSessionRequest(session_id=session, page_size=1000, page_token=token),
                metadata=cluster.metadata("wire-test"),
                timeout=20,
            )
            pages.append(page)
            token = page.next_page_token
            if not token:
                return pages


async def refusal(cluster: LocalCluster, root: str, target: str) -> mesh_pb2.Rejection:
    """The ``Rejection`` in the trailer of a send the target's node refuses: the root as a
    sender the calling node (node-b) does not host."""
    lead = (await read_all(cluster, root))[0].activation
    async with cluster.channel("node-b", client="node-b") as channel:
        try:
            await mesh_pb2_grpc.AgentMeshStub(channel).SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=mesh_pb2.AgentRef(session_id=root, activation_id=lead.activation_id),
                    agent_id=target,
                    message="Forged.",
                    idempotency_key="forged-1",
                ),
                metadata=cluster.metadata("node-b"),
                timeout=20,
            )
        except grpc.aio.AioRpcError as error:
            trailers = dict(error.trailing_metadata() or ())
            status = status_pb2.Status.FromString(trailers[DETAILS_METADATA_KEY])
            rejection = mesh_pb2.Rejection()
            assert any(d.Unpack(rejection) for d in status.details)
            return rejection
    raise AssertionError("a forged send was accepted")


async def test_every_documented_field_is_filled_on_the_wire(cluster: LocalCluster) -> None:
    root, events = await exchange(cluster)
    [child] = {e.session_id for e in events} - {root}
    sessions = {session: await read_all(cluster, session) for session in (root, child)}
    async with cluster.channel("node-a", client="wire-test") as channel:
        listing = await mesh_pb2_grpc.MeshControlStub(channel).ListAgents(
            mesh_pb2.ListAgentsRequest(root_session_id=root, count=True, with_approvals=True),
            metadata=cluster.metadata("wire-test"),
            timeout=20,
        )
    rejection = await refusal(cluster, root, child)
    pages = [page for read in sessions.values() for page in read]

    never = [
        field
        for field in never_set([*pages, listing, *events, rejection])
        if field not in NOT_IN_SCENARIO
    ]
    assert never == [], f"documented but never filled: {never}"

    # The ones that were once never filled, on every instance.
    assert (rejection.target_session_id, rejection.reason) == (
        child,
        mesh_pb2.REJECTION_REASON_FORGED_SENDER,
    )
    for read in sessions.values():
        assert read[0].header.HasField("created_at")
    entries = [entry for page in pages for entry in page.transcript]
    entries += [event.entry for event in events if event.HasField("entry")]
    assert all(entry.HasField("recorded_at") for entry in entries)
    for entry in entries:
        body = entry.WhichOneof("body")
        if body == "agent_message":
            assert entry.agent_message.idempotency_key, entry
        if body == "human_prompt":
            assert entry.human_prompt.idempotency_key == "prompt-1", entry
    # Every turn says where it ran: the node of an activation the watch saw for its session.
    hosts = {
        (e.session_id, e.activated.activation_id): e.activated.node_id
        for e in events
        if e.HasField("activated")
    }
    for session, read in sessions.items():
        starts = [e.turn_started for p in read for e in p.transcript if e.HasField("turn_started")]
        assert starts, session
        for start in starts:
            assert start.node_id in {node.node_id for node in cluster}, start
            assert start.activation_id, start
            assert hosts.get((session, start.activation_id), start.node_id) == start.node_id
