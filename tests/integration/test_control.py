"""The control plane on a real cluster: any node serves any request, forwarding to the node
that hosts the session; creation is idempotent across nodes; reads page; watches resume."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    IdempotencyConflict,
    InvalidArgument,
    MeshError,
    RejectionReason,
    SessionId,
    SessionUnknown,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader
from dsh_mesh.transport import error_from_rpc


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:TREE"
    ) as running:
        yield running


async def call(cluster: LocalCluster, node: str, method: str, request: object) -> object:
    address = cluster[node].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        try:
            return await getattr(stub, method)(
                request, metadata=cluster.metadata("a-human"), timeout=20
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error


async def watch(
    cluster: LocalCluster,
    node: str,
    request: mesh_pb2.WatchSessionRequest,
    until: Callable[[list[mesh_pb2.SessionEvent]], bool],
) -> list[mesh_pb2.SessionEvent]:
    address = cluster[node].address
    assert address is not None
    events: list[mesh_pb2.SessionEvent] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        stream = stub.WatchSession(request, metadata=cluster.metadata("a-human"), timeout=20)
        async for event in stream:
            events.append(event)
            if until(events):
                stream.cancel()
                break
    return events


def create(request_id: str, *, node: str = "", preset: str = "lead") -> object:
    return mesh_pb2.CreateRootSessionRequest(
        preset=preset, initial_task="Grow a tree.", request_id=request_id, node_id=node
    )


@pytest.fixture(scope="module")
def root(cluster: LocalCluster) -> str:
    """A root placed on node-c by a call to node-b, with its whole tree resident."""

    async def build() -> str:
        created = await call(
            cluster, "node-b", "CreateRootSession", create("tree-1", node="node-c")
        )
        assert isinstance(created, mesh_pb2.CreateRootSessionResponse)
        assert created.node_id == "node-c"
        async with MeshReader(cluster.settings) as reader:
            await reader.wait_for(
                reader.sessions, lambda headers: len(headers) == 6, what="the whole tree"
            )
        return str(created.session_id)

    return asyncio.run(build())


async def test_creation_is_idempotent_across_nodes(cluster: LocalCluster, root: str) -> None:
    again = await call(cluster, "node-a", "CreateRootSession", create("tree-1", node="node-c"))
    assert isinstance(again, mesh_pb2.CreateRootSessionResponse)
    assert (again.session_id, again.node_id) == (root, "node-c")
    with pytest.raises(IdempotencyConflict):
        await call(cluster, "node-a", "CreateRootSession", create("tree-1", preset="branch"))


@pytest.mark.parametrize("model", ["openai:", ":gpt-4o-mini", "  "])
async def test_a_model_spec_naming_no_model_is_refused_at_creation(
    cluster: LocalCluster, model: str
) -> None:
    request = mesh_pb2.CreateRootSessionRequest(
        preset="lead", initial_task="Grow a tree.", request_id=f"empty-{model!r}", model=model
    )
    with pytest.raises(InvalidArgument, match=r"names no|is empty") as refused:
        await call(cluster, "node-a", "CreateRootSession", request)
    assert refused.value.reason is RejectionReason.INVALID_ARGUMENT
    async with MeshReader(cluster.settings) as reader:  # nothing was registered for it
        assert not [h for h in await reader.sessions() if h.spec.model == model]


def usage_of(entries: Iterable[mesh_pb2.TranscriptEntry]) -> mesh_pb2.SessionUsage:
    """The usage summary ``entries`` add up to, worked out here from their steps."""
    steps = [e.assistant_step.usage for e in entries if e.WhichOneof("body") == "assistant_step"]
    expected = mesh_pb2.SessionUsage(
        model_calls=len(steps),
        input_tokens=sum(u.input_tokens for u in steps),
        output_tokens=sum(u.output_tokens for u in steps),
        cached_input_tokens=sum(u.cached_input_tokens for u in steps),
        cost_usd=0.0,  # TREE names no price: every call is unpriced, none free
        unpriced_calls=len(steps),
    )
    if steps:
        expected.first_call.CopyFrom(steps[0])
    return expected


async def test_any_node_pages_through_a_transcript(cluster: LocalCluster, root: str) -> None:
    first = await call(cluster, "node-a", "GetSession", mesh_pb2.GetSessionRequest(session_id=root))
    assert isinstance(first, mesh_pb2.Session)
    assert first.activation.node_id == "node-c"
    assert first.state == mesh_pb2.AGENT_STATE_RUNNING  # answered by its host: it is stalled
    assert not first.next_page_token  # the whole transcript: the summary is its steps' sum
    assert first.HasField("usage")
    assert first.usage == usage_of(first.transcript)
    # The scripted model reports rough input tokens and 8 output tokens a call, nothing cached.
    assert first.usage.model_calls >= 1
    assert first.usage.input_tokens > 0
    assert first.usage.output_tokens == 8 * first.usage.model_calls
    assert first.usage.cached_input_tokens == 0
    assert first.usage.first_call.output_tokens == 8
    seqs: list[int] = []
    entries: list[mesh_pb2.TranscriptEntry] = []
    token = ""
    while True:
        page = await call(
            cluster,
            "node-b",
            "GetSession",
            mesh_pb2.GetSessionRequest(session_id=root, page_size=2, page_token=token),
        )
        assert isinstance(page, mesh_pb2.Session)
        assert len(page.transcript) <= 2
        seqs.extend(e.seq for e in page.transcript)
        entries.extend(page.transcript)
        # Every page carries the summary of the WHOLE transcript, not of its two entries.
        assert page.usage.model_calls >= first.usage.model_calls
        token = page.next_page_token
        if not token:
            break
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 6
    # The last page reaches the end in the same read as its summary: the sum of every page.
    assert page.usage == usage_of(entries)
    with pytest.raises(InvalidArgument):
        await call(
            cluster,
            "node-a",
            "GetSession",
            mesh_pb2.GetSessionRequest(session_id=root, page_token="not-ours"),
        )
    with pytest.raises(SessionUnknown):
        await call(
            cluster, "node-a", "GetSession", mesh_pb2.GetSessionRequest(session_id="s-nobody")
        )


async def test_an_absent_session_reports_its_usage_too(cluster: LocalCluster, root: str) -> None:
    listed = await call(
        cluster, "node-a", "ListAgents", mesh_pb2.ListAgentsRequest(root_session_id=root)
    )
    assert isinstance(listed, mesh_pb2.ListAgentsResponse)
    (quick,) = [a for a in listed.agents if a.header.spec.preset == "quick"]
    # The one-shot child answered once and settled: absent, read from the registry.
    async with MeshReader(cluster.settings) as reader:
        await reader.wait_for(
            lambda: reader.activation(SessionId(quick.header.session_id)),
            lambda activation: activation is None,
            what="the one-shot child settled",
        )
    read = await call(
        cluster,
        "node-b",
        "GetSession",
        mesh_pb2.GetSessionRequest(session_id=quick.header.session_id),
    )
    assert isinstance(read, mesh_pb2.Session)
    assert read.state == mesh_pb2.AGENT_STATE_ABSENT
    assert read.usage == usage_of(read.transcript)
    assert read.usage.model_calls == 1
    assert read.usage.output_tokens == 8
    assert read.usage.input_tokens == read.usage.first_call.input_tokens > 0


async def test_list_agents_filters_and_pages(cluster: LocalCluster, root: str) -> None:
    listed = await call(
        cluster, "node-a", "ListAgents", mesh_pb2.ListAgentsRequest(root_session_id=root)
    )
    assert isinstance(listed, mesh_pb2.ListAgentsResponse)
    ids = [a.header.session_id for a in listed.agents]
    assert ids[0] == root and len(ids) == 6
    parents = {a.header.session_id: a.header.parent_session_id for a in listed.agents}
    assert all(ids.index(p) < ids.index(s) for s, p in parents.items() if p)
    resident = await call(
        cluster,
        "node-a",
        "ListAgents",
        mesh_pb2.ListAgentsRequest(root_session_id=root, resident_only=True),
    )
    assert isinstance(resident, mesh_pb2.ListAgentsResponse)
    assert len(resident.agents) == 5  # the one-shot child settled
    paged: list[str] = []
    token = ""
    while True:
        page = await call(
            cluster,
            "node-b",
            "ListAgents",
            mesh_pb2.ListAgentsRequest(root_session_id=root, page_size=4, page_token=token),
        )
        assert isinstance(page, mesh_pb2.ListAgentsResponse)
        paged.extend(a.header.session_id for a in page.agents)
        token = page.next_page_token
        if not token:
            break
    assert paged == ids


async def test_a_tree_watch_resumes_after_a_disconnect_without_gaps_or_repeats(
    cluster: LocalCluster, root: str
) -> None:
    async with MeshReader(cluster.settings) as reader:
        expected = set()
        for header in await reader.sessions():
            for record in await reader.transcript(header.session_id):
                expected.add((header.session_id, record.seq))

    def entries(events: list[mesh_pb2.SessionEvent]) -> list[tuple[str, int]]:
        return [(e.session_id, e.entry.seq) for e in events if e.HasField("entry")]

    first = await watch(
        cluster,
        "node-a",
        mesh_pb2.WatchSessionRequest(session_id=root, tree=True),
        lambda events: len(events) == 7,
    )
    last = first[-1].event_seq
    assert [e.event_seq for e in first] == sorted(e.event_seq for e in first)
    rest = await watch(
        cluster,
        "node-b",
        mesh_pb2.WatchSessionRequest(session_id=root, tree=True, after_event_seq=last),
        lambda events: set(entries(first)) | set(entries(events)) >= expected,
    )
    # No entry repeats; residency is state, told again (at the position resumed from) first.
    assert all(e.event_seq > last for e in rest if e.HasField("entry"))
    assert all(e.event_seq >= last for e in rest)
    seen = entries([*first, *rest])
    assert len(seen) == len(set(seen))
    assert set(seen) == expected
    # A resumed feed starts by telling who is resident now.
    replayed = await watch(
        cluster,
        "node-c",
        mesh_pb2.WatchSessionRequest(session_id=root, after_event_seq=1),
        lambda events: any(e.HasField("activated") for e in events),
    )
    assert replayed[-1].activated.session_id == root
    assert replayed[-1].activated.node_id == "node-c"


async def test_prompt_and_interrupt_reach_the_hosting_node(
    cluster: LocalCluster, root: str
) -> None:
    prompt = mesh_pb2.SubmitPromptRequest(session_id=root, text="Status?", idempotency_key="p1")
    accepted = await call(cluster, "node-a", "SubmitPrompt", prompt)
    again = await call(cluster, "node-b", "SubmitPrompt", prompt)
    assert isinstance(accepted, mesh_pb2.SubmitPromptResponse)
    assert isinstance(again, mesh_pb2.SubmitPromptResponse)
    assert not accepted.duplicate and again.duplicate
    assert again.accepted_seq == accepted.accepted_seq
    stopped = await call(cluster, "node-a", "Interrupt", mesh_pb2.InterruptRequest(session_id=root))
    assert isinstance(stopped, mesh_pb2.InterruptResponse)
    assert stopped.interrupted and stopped.turn_id
    async with MeshReader(cluster.settings) as reader:
        records = await reader.wait_for(
            lambda: reader.transcript(SessionId(root)),
            lambda rs: any(
                isinstance(r.entry, TurnEndedEntry) and r.entry.outcome is TurnOutcome.CANCELLED
                for r in rs
            ),
            what="the cancelled turn",
        )
    assert records
    with pytest.raises(MeshError):
        await call(
            cluster,
            "node-a",
            "SubmitPrompt",
            mesh_pb2.SubmitPromptRequest(session_id=root, text="", idempotency_key="p2"),
        )


async def test_a_root_created_in_a_namespace_keeps_its_tree_there(cluster: LocalCluster) -> None:
    made = await call(
        cluster,
        "node-b",
        "CreateRootSession",
        mesh_pb2.CreateRootSessionRequest(
            preset="lead", initial_task="Grow a tree.", request_id="ns-1", namespace="team-a"
        ),
    )
    assert isinstance(made, mesh_pb2.CreateRootSessionResponse)
    async with MeshReader(cluster.settings) as reader:
        tree = await reader.wait_for(
            reader.sessions,
            lambda headers: sum(h.namespace == "team-a" for h in headers) == 6,
            what="the whole tree in team-a",
        )
    assert {h.session_id for h in tree if h.namespace == "team-a"} >= {made.session_id}
    read = await call(
        cluster, "node-a", "GetSession", mesh_pb2.GetSessionRequest(session_id=made.session_id)
    )
    assert isinstance(read, mesh_pb2.Session) and read.header.namespace == "team-a"
    # A request id is one namespace's own: the same one in another namespace is another root
    # (it tells nothing of the first, ADR 0033).
    other = await call(
        cluster,
        "node-a",
        "CreateRootSession",
        mesh_pb2.CreateRootSessionRequest(
            preset="lead", initial_task="Grow a tree.", request_id="ns-1", namespace="team-b"
        ),
    )
    assert isinstance(other, mesh_pb2.CreateRootSessionResponse)
    assert other.session_id != made.session_id
    with pytest.raises(IdempotencyConflict):  # the same request id in team-a, another task
        await call(
            cluster,
            "node-a",
            "CreateRootSession",
            mesh_pb2.CreateRootSessionRequest(
                preset="lead", initial_task="Another tree.", request_id="ns-1", namespace="team-a"
            ),
        )
    for bad in ("Team-A", "-a", "a" * 64):
        with pytest.raises(InvalidArgument, match="namespace"):
            await call(
                cluster,
                "node-c",
                "CreateRootSession",
                mesh_pb2.CreateRootSessionRequest(
                    preset="lead", initial_task="x", request_id=f"ns-bad-{bad}", namespace=bad
                ),
            )
