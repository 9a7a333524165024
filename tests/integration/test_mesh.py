"""The mesh on real node processes and a real etcd: cross-node delivery in both directions,
cold-resume races, host failure (SIGKILL), the paused zombie (SIGSTOP) and graceful drain
(SIGTERM). Every check reads the durable state in etcd."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    AgentMessageEntry,
    AssistantStepEntry,
    ConsumedEntry,
    NodeId,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    TargetElsewhere,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
    pending_inbound,
)
from dsh_mesh.registry import Etcd, EtcdConfig
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    boundary_violations,
    calls_without_one_answer,
)
from tests.integration.mesh_client import (
    children_of,
    create_root,
    live_ref,
    messages,
    notices,
    send_as,
    started_child,
)

ClusterFactory = Callable[[str], LocalCluster]


@pytest.fixture
def start_cluster(etcd: EtcdAddress) -> Iterator[ClusterFactory]:
    """Start a three-node cluster running a scenario of tests/integration/scenarios.py."""
    started: list[LocalCluster] = []

    def start(scenario: str) -> LocalCluster:
        cluster = LocalCluster(
            etcd_endpoint=etcd.endpoint, scenario=f"tests.integration.scenarios:{scenario}"
        )
        started.append(cluster)
        return cluster.__enter__()

    yield start
    for cluster in started:
        cluster.close()


@pytest.fixture
async def open_reader() -> AsyncIterator[Callable[[LocalCluster], MeshReader]]:
    readers: list[MeshReader] = []

    def open_(cluster: LocalCluster) -> MeshReader:
        reader = MeshReader(cluster.settings)
        readers.append(reader)
        return reader

    yield open_
    for reader in readers:
        await reader.__aexit__()


async def only_child(reader: MeshReader, root: SessionId) -> SessionId:
    children = await reader.wait_for(
        lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
    )
    return children[0].session_id


@pytest.mark.contract(3)
@pytest.mark.contract(9)
async def test_messages_cross_nodes_in_both_directions(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("EXCHANGE")
    async with open_reader(cluster) as reader:
        root = SessionId(await create_root(cluster, on="node-a", task="Survey the stack."))
        child = await only_child(reader, root)
        at_root = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: bool(notices(records)),
            what="the child's settlement notice",
        )
        # child -> parent, across nodes: attributed to the child, before its notice.
        assert [(m.source.sender_session_id, m.content) for m in messages(at_root)] == [
            (child, "Progress: leases have a TTL."),
            (child, "Result: keys bound to an expired lease vanish."),
        ]
        last_message = max(r.seq for r in at_root if isinstance(r.entry, AgentMessageEntry))
        first_notice = min(r.seq for r in at_root if isinstance(r.entry, SettlementNoticeEntry))
        assert last_message < first_notice
        assert notices(at_root)[0].outcome is SettlementOutcome.COMPLETED
        # parent -> child, across nodes: the follow-up is in the child's durable transcript.
        at_child = await reader.transcript(child)
        assert [(m.source.sender_session_id, m.content) for m in messages(at_child)] == [
            (root, "Follow-up: what happens past the TTL?")
        ]
        hosts = {n.node_id for n in cluster}
        child_header = await reader.header(child)
        assert child_header is not None and child_header.parent_session == root
        assert hosts == {"node-a", "node-b", "node-c"}


@pytest.mark.contract(9)
async def test_messages_from_children_on_two_nodes_are_read_in_acceptance_order(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    # Both children (on node-b and node-c) report while their parent (on node-a) is in one slow
    # model call; their sends reach node-a at about the same moment. Each step boundary of the
    # parent reads what waits in seq order and leaves nothing durable before it unread.
    cluster = start_cluster("TOGETHER")
    async with open_reader(cluster) as reader:
        root = SessionId(await create_root(cluster, on="node-a", task="Delegate twice."))
        at_root = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: len(notices(records)) == 2 and not pending_inbound(records),
            what="both children's settlement notices, read",
        )
        reports = [r for r in at_root if isinstance(r.entry, AgentMessageEntry)]
        assert len(reports) == 2
        # Two senders; others-first placement put the first child on node-b, the second on
        # node-c (the cluster's default placement, round-robin over the other nodes).
        assert len({r.entry.source.sender_session_id for r in reports}) == 2  # type: ignore[union-attr]
        assert boundary_violations(at_root) == []
        read = [s for r in at_root if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs]
        order = [s for s in read if s in {r.seq for r in reports}]
        assert order == sorted(order) == [r.seq for r in reports]


@pytest.mark.contract(3)
async def test_a_cold_resume_race_has_one_winner_and_one_delivery(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("SETTLING")
    async with open_reader(cluster) as reader:
        root = SessionId(await create_root(cluster, on="node-a", task="Delegate."))
        child = await only_child(reader, root)
        await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="child settled"
        )
        assert await reader.activation(child) is None
        parent, host = await live_ref(reader, root)

        # Acting as the parent's node, hand the same message (same key) to two nodes at once:
        # both race to win the absent child's activation in etcd.
        async def hand_to(node: str) -> mesh_pb2.SendMessageResponse | TargetElsewhere:
            try:
                return await send_as(
                    cluster, via=node, caller=host, sender=parent, target=child,
                    message="Once more, please.", key="race-1", hops=1,
                )  # fmt: skip
            except TargetElsewhere as moved:
                return moved

        outcomes = await asyncio.gather(hand_to("node-b"), hand_to("node-c"))
        won = [o for o in outcomes if isinstance(o, mesh_pb2.SendMessageResponse)]
        lost = [o for o in outcomes if isinstance(o, TargetElsewhere)]
        resident = await reader.activation(child)
        assert resident is not None
        if lost:  # the loser names the winner, as the parent's node would learn it ...
            (moved,) = lost
            assert (moved.node_id, moved.activation_id) == (
                resident.node_id,
                resident.activation_id,
            )
            # ... and following it, as that node does, returns the one acceptance.
            again = await send_as(
                cluster, via=moved.node_id, caller=host, sender=parent, target=child,
                message="Once more, please.", key="race-1", hops=1,
            )  # fmt: skip
            won.append(again)
        first, second = won
        assert sorted([first.duplicate, second.duplicate]) == [False, True]
        assert first.accepted_seq == second.accepted_seq
        assert first.target_activation_id == second.target_activation_id == resident.activation_id
        records = await reader.transcript(child)
        copies = [m for m in messages(records) if m.content == "Once more, please."]
        assert len(copies) == 1
        turns = [r for r in records if isinstance(r.entry, TurnStartedEntry)]
        assert len(turns) == 2  # the first activation's turn and the one resumed turn


@pytest.mark.contract(8)
async def test_sigkill_of_a_childs_host_settles_it_lost_then_it_resumes_elsewhere(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("CRASH")
    async with open_reader(cluster) as reader:
        root, child = await started_child(cluster, reader)
        parent, root_host = await live_ref(reader, root)
        before = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Acknowledged before the crash.", key="before",
        )  # fmt: skip
        _, child_host = await live_ref(reader, child)
        cluster[child_host].kill()
        at_root = await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        (notice,) = notices(at_root)
        assert notice.child_session == child
        assert notice.outcome is SettlementOutcome.LOST
        assert notice.terminal_output == "Found 3 leases so far."
        after = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Resume and finish.", key="after",
        )  # fmt: skip
        resumed = await reader.activation(child)
        assert resumed is not None and resumed.node_id not in (child_host,)
        assert after.target_activation_id == resumed.activation_id
        records = await reader.wait_for(
            lambda: reader.transcript(child),
            lambda rs: any(
                isinstance(r.entry, ConsumedEntry) and after.accepted_seq in r.entry.seqs
                for r in rs
            ),
            what="the resumed child consumed the new message",
        )
        consumed = {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
        assert {before.accepted_seq, after.accepted_seq} <= consumed  # nothing acknowledged lost


async def test_a_call_its_killed_host_left_open_is_answered_once_before_the_next_model_call(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    # The child's step sent "Started." (answered) and then called a tool that never returns;
    # its host is SIGKILLed with that call open. Cold-resumed on another node by its parent's
    # message, it answers the open call first, ends the dead host's turn as lost, and only then
    # calls the model (strict: a dangling call would fail that call with OpenAI's 400).
    cluster = start_cluster("HANGS")
    async with open_reader(cluster) as reader:
        root, child = await started_child(cluster, reader)
        await reader.wait_for(
            lambda: reader.transcript(child),
            lambda rs: any(
                isinstance(r.entry, ToolResultEntry) and r.entry.name == "send_message" for r in rs
            ),
            what="the send's result (the hang call is then running)",
        )
        parent, root_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
        cluster[child_host].kill()
        at_root = await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        [noticed] = [r for r in at_root if isinstance(r.entry, SettlementNoticeEntry)]
        after = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Carry on.", key="after-kill",
        )  # fmt: skip
        records = await reader.wait_for(
            lambda: reader.transcript(child),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the lost turn and the resumed one, ended",
        )
        assert calls_without_one_answer(records) == []
        [hang] = [
            r.entry
            for r in records
            if isinstance(r.entry, ToolResultEntry) and r.entry.name == "hang"
        ]
        assert hang.is_error and json.loads(hang.content)["outcome"] == "unknown"
        # A lost run's leftovers are announced or ordered (ADR 0043): the notice names the call
        # left open, unless the resumed child had answered it before the notice was written.
        [answered] = [r for r in records if r.entry == hang]
        assert noticed.recorded_at is not None and answered.recorded_at is not None
        lost = noticed.entry
        assert isinstance(lost, SettlementNoticeEntry)
        assert "left 1 call(s) open (hang)" in lost.detail or (
            answered.recorded_at <= noticed.recorded_at
        ), (lost.detail, answered.recorded_at, noticed.recorded_at)
        ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
        assert ended == [TurnOutcome.LOST, TurnOutcome.COMPLETED]
        consumed = {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
        assert after.accepted_seq in consumed
        steps = [r.entry.text for r in records if isinstance(r.entry, AssistantStepEntry)]
        assert steps[-1] == "Resumed and read it."


@pytest.mark.contract(3)
async def test_a_paused_zombie_node_cannot_append_after_its_lease_expired(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("CRASH")
    async with open_reader(cluster) as reader:
        root, child = await started_child(cluster, reader)
        _, zombie = await live_ref(reader, child)
        cluster[zombie].pause()  # mid slow step: its model call answers while it is frozen
        await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        parent, root_host = await live_ref(reader, root)
        await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Take over.", key="take-over",
        )  # fmt: skip
        finished = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda r: len(notices(r)) == 2,
            what="the resumed child settled",
        )
        assert notices(finished)[1].outcome is SettlementOutcome.COMPLETED
        cluster[zombie].resume()
        log = await reader.wait_for(
            lambda: asyncio.to_thread(cluster[zombie].log),
            lambda text: "fenced" in text,
            what="the zombie noticing it is fenced",
        )
        assert "lost its lease: fenced" in log or "fenced, dropping the stale agent" in log
        records = await reader.transcript(child)
        slow_steps = [
            r
            for r in records
            if isinstance(r.entry, AssistantStepEntry) and r.entry.text == "Slow step finished."
        ]
        assert len(slow_steps) == 1  # the new activation's; the zombie's late step was refused


async def test_sigterm_drains_and_another_node_resumes_the_child_at_once(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("CRASH")
    async with open_reader(cluster) as reader:
        root, child = await started_child(cluster, reader)
        _, child_host = await live_ref(reader, child)
        assert await asyncio.to_thread(cluster[child_host].terminate) == 0
        # Released on the way out, not left to expire with the lease.
        assert await reader.activation(child) is None
        parent, root_host = await live_ref(reader, root)
        delivery = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Carry on elsewhere.", key="carry-on",
        )  # fmt: skip
        resumed = await reader.activation(child)
        assert resumed is not None and resumed.node_id != child_host
        assert delivery.target_activation_id == resumed.activation_id


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


async def test_nodes_serve_health_and_reflection_without_the_cluster_token(
    start_cluster: ClusterFactory,
) -> None:
    cluster = start_cluster("EXCHANGE")
    address = cluster["node-b"].address
    assert address is not None
    assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
    services = {s.name for s in responses[0].list_services_response.service}
    assert {
        "dsh.mesh.v1.AgentMesh",
        "dsh.mesh.v1.MeshControl",
        "dsh.mesh.peer.v1.MeshPeer",
        "grpc.health.v1.Health",
    } <= services


async def test_a_fenced_node_re_registers_and_serves_again(
    start_cluster: ClusterFactory, open_reader: Callable[[LocalCluster], MeshReader]
) -> None:
    cluster = start_cluster("EXCHANGE")
    node = cluster["node-c"]
    assert node.address is not None
    async with open_reader(cluster) as reader:
        key = reader.keys.node(NodeId("node-c"))
        etcd = Etcd(EtcdConfig(endpoint=cluster.settings.etcd_endpoint))
        async with etcd:
            first = await etcd.get(key)
            assert first is not None
            node.pause()
            await reader.wait_for(lambda: etcd.get(key), lambda kv: kv is None, what="expiry")
            node.resume()
            again = await reader.wait_for(
                lambda: etcd.get(key), lambda kv: kv is not None, what="re-registration"
            )
        assert again is not None and again.lease != first.lease  # the old lease is gone for good
    assert "lost its lease: fenced" in node.log()
    assert await _health(node.address) == health_pb2.HealthCheckResponse.SERVING
