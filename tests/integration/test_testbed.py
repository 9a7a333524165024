"""The mesh on the multi-host test bed (deploy/testbed/): three hosts in network namespaces on
one bridge, a three-member etcd cluster across them, one node per host, and a fourth host
running the PostgreSQL that keeps every cluster's transcripts. Cross-host messages, a host cut
off from the network and brought back, a host cut from etcd but not from the database, an etcd
member stopped, the etcd leader killed, and a delaying, lossy proxy in front of one node. Needs
root; skipped with the reason otherwise, except under CI (``CI`` set), where a bed that cannot
be made is a failure.

The TCP proxy's own test runs on loopback, without root.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AgentRef,
    AssistantStepEntry,
    ConsumedEntry,
    MeshError,
    NodeId,
    Rejected,
    RejectionReason,
    SettlementOutcome,
)
from dsh_mesh.registry import Etcd
from dsh_mesh.testing import (
    BedCluster,
    BedError,
    BedNode,
    LocalPki,
    MeshReader,
    MultiHostBed,
    PatientReader,
    TcpProxy,
    bed_unavailable_reason,
    patiently,
)
from dsh_mesh.transport import error_from_rpc, secure_channel
from tests.integration.mesh_client import (
    children_of,
    create_root,
    live_ref,
    messages,
    notices,
    started_child,
)

TLS = True
"""Mutual TLS on the bed (every node and etcd member with its own certificate)."""

StartCluster = Callable[..., BedCluster]
T = TypeVar("T")


@pytest.fixture(scope="module")
def bed() -> Iterator[MultiHostBed]:
    reason = bed_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the multi-host test bed, but: {reason}")
        pytest.skip(f"multi-host test bed not available: {reason}")
    with MultiHostBed(tls=TLS) as made:
        print(f"\n{made}: bridge {made.bridge} at {made.bridge_address}")
        yield made


@pytest.fixture
def start_cluster(bed: MultiHostBed) -> Iterator[StartCluster]:
    """Start a node on every host running a scenario of tests/integration/scenarios.py; after
    the test, undo every fault and stop the nodes, whatever happened."""
    clusters: list[BedCluster] = []

    def start(scenario: str, **options: Any) -> BedCluster:
        cluster = bed.cluster(f"tests.integration.scenarios:{scenario}", **options)
        clusters.append(cluster)
        cluster.__enter__()
        return cluster

    yield start
    bed.restore_all()
    for cluster in clusters:
        cluster.close()
    for name, member in bed.etcd.items():
        if not member.running:
            bed.start_etcd(name)


@pytest.fixture
async def reader_of() -> AsyncIterator[Callable[[BedCluster], MeshReader]]:
    readers: list[MeshReader] = []

    def open_(cluster: BedCluster) -> MeshReader:
        reader = PatientReader(cluster.settings)
        readers.append(reader)
        return reader

    yield open_
    for reader in readers:
        await reader.__aexit__()


def channel(
    cluster: BedCluster, node: str, *, as_node: str | None = None, address: str | None = None
) -> grpc.aio.Channel:
    """A channel to ``node`` (at its published address unless ``address``): plaintext, or
    mutual TLS with the certificate of node ``as_node`` (a client certificate when None)."""
    target = address or cluster[node].address
    assert target is not None
    pki = cluster.settings.tls
    if pki is None:
        return grpc.aio.insecure_channel(target)
    files = pki.client("tester") if as_node is None else pki.node(as_node)
    return secure_channel(target, files.credentials(), server_name=node)


async def send_as(
    cluster: BedCluster,
    *,
    via: str,
    caller: str,
    sender: AgentRef,
    target: str,
    message: str,
    key: str,
) -> mesh_pb2.SendMessageResponse:
    """``SendMessage`` on node ``via``, as node ``caller`` (its certificate under TLS, its name
    and the cluster token in plaintext). Raises the decoded ``MeshError`` on refusal."""
    request = mesh_pb2.SendMessageRequest(
        sender=mesh_pb2.AgentRef(session_id=sender.session_id, activation_id=sender.activation_id),
        agent_id=target,
        message=message,
        idempotency_key=key,
    )
    async with channel(cluster, via, as_node=caller) as to_node:
        try:
            response: mesh_pb2.SendMessageResponse = await mesh_pb2_grpc.AgentMeshStub(
                to_node
            ).SendMessage(request, metadata=cluster.metadata(caller), timeout=30)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
    return response


async def leases(cluster: BedCluster, reader: MeshReader) -> dict[str, int | None]:
    """Each node's registration lease in etcd (None: not registered)."""
    async with Etcd(cluster.settings.etcd_config()) as etcd:
        found = {}
        for node in cluster.nodes:
            key = reader.keys.node(NodeId(node))
            kv = await patiently(lambda: etcd.get(key))  # noqa: B023 (awaited at once)
            found[node] = None if kv is None else int(kv.lease)
        return found


async def health(cluster: BedCluster, node: str, *, address: str | None = None) -> int:
    async with channel(cluster, node, address=address) as to_node:
        reply = await health_pb2_grpc.HealthStub(to_node).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def fenced(cluster: BedCluster) -> list[str]:
    """The nodes whose logs say they lost their lease."""
    return [node.node_id for node in cluster if "lost its lease" in node.log()]


async def exchange(
    cluster: BedCluster, reader: MeshReader, *, on: str, completed: bool = True
) -> SettlementOutcome:
    """Run the EXCHANGE scenario from a root on node ``on`` and check every message crossed
    hosts once, in order, in both directions, and (``completed``) that the child's settlement
    notice says it completed. Returns the notice's outcome."""
    root = await create_root(cluster, on=on, task="Survey the stack.")
    children = await reader.wait_for(
        lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
    )
    child = children[0].session_id
    at_root = await reader.wait_for(
        lambda: reader.transcript(root),
        lambda records: bool(notices(records)),
        what="the child's settlement notice",
    )
    assert [(m.source.sender_session_id, m.content) for m in messages(at_root)] == [
        (child, "Progress: leases have a TTL."),
        (child, "Result: keys bound to an expired lease vanish."),
    ]
    outcome = notices(at_root)[0].outcome
    if completed:
        assert outcome is SettlementOutcome.COMPLETED
    at_child = await reader.wait_for(
        lambda: reader.transcript(child),
        lambda records: bool(messages(records)),
        what="the parent's follow-up at the child",
    )
    assert [(m.source.sender_session_id, m.content) for m in messages(at_child)] == [
        (root, "Follow-up: what happens past the TTL?")
    ]
    return outcome


# -- the proxy, on loopback ---------------------------------------------------------------------


async def test_the_proxy_delays_and_loses_chunks_but_keeps_the_stream_whole() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = TcpProxy(listen=("127.0.0.1", 0), upstream=("127.0.0.1", port), delay=0.03, seed=7)
    async with server, proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        started = time.monotonic()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        round_trip = time.monotonic() - started
        assert round_trip >= 2 * 0.03  # held back once on the way there, once on the way back

        proxy.shape(delay=0.001, loss=0.3, retransmit_delay=0.02)
        payload = random.Random(1).randbytes(300_000)
        for offset in range(0, len(payload), 1000):
            writer.write(payload[offset : offset + 1000])
        await writer.drain()
        assert await reader.readexactly(len(payload)) == payload  # in order, nothing lost
        assert proxy.stats.lost > 0

        await proxy.reset_all()
        assert await reader.read() == b""  # the link broke: the client sees the connection end
        writer.close()
    print(f"\nproxy: 30 ms each way gave a {round_trip * 1000:.0f} ms round trip; {proxy.stats}")


# -- the bed --------------------------------------------------------------------------------------


async def test_messages_cross_hosts_in_both_directions(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    cluster = start_cluster("EXCHANGE")
    assert bed.network is not None
    for node in cluster:
        assert node.address is not None
        host = cluster.host_of(node.node_id)
        # Each node serves on its own host's address, inside the bed's network.
        assert node.address.rpartition(":")[0] == host.address
        assert any(node.pid == pid for pid in bed.pids(host.name))
    async with reader_of(cluster) as reader:
        await exchange(cluster, reader, on="node-a")
    assert fenced(cluster) == []


async def test_only_the_certificate_names_the_caller_on_the_bed(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    cluster = start_cluster("CRASH")
    pki = cluster.settings.tls
    assert TLS and pki is not None, "the bed runs with mutual TLS"
    async with reader_of(cluster) as reader:
        root, child = await started_child(cluster, reader)
        lead, lead_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
        before = await reader.transcript(child)
    impostor = next(n for n in cluster.nodes if n not in (lead_host, child_host))
    # A genuine node certificate speaking for an agent its node does not host: refused.
    with pytest.raises(Rejected) as forged:
        await send_as(
            cluster, via=child_host, caller=impostor, sender=lead, target=child,
            message="I am the lead.", key="forged-1",
        )  # fmt: skip
    assert forged.value.reason is RejectionReason.FORGED_SENDER
    # A client certificate is no node at all: refused on the node-to-node service.
    async with channel(cluster, child_host) as as_client:
        with pytest.raises(grpc.aio.AioRpcError) as client:
            await mesh_pb2_grpc.AgentMeshStub(as_client).SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=mesh_pb2.AgentRef(
                        session_id=lead.session_id, activation_id=lead.activation_id
                    ),
                    agent_id=child,
                    message="From a client.",
                    idempotency_key="client-1",
                ),
                timeout=10,
            )
    decoded = error_from_rpc(client.value)
    assert isinstance(decoded, Rejected) and decoded.reason is RejectionReason.FORGED_SENDER
    # A node that presents the certificate of another name than the one dialled, no
    # certificate at all, or one from another CA: the handshake fails.
    child_address = cluster[child_host].address
    assert child_address is not None
    wrong_name = secure_channel(
        child_address, pki.node(impostor).credentials(), server_name=impostor
    )
    with LocalPki() as strangers:
        foreign = secure_channel(
            child_address, strangers.client("stranger").credentials(), server_name=child_host
        )
        for refused in (wrong_name, grpc.aio.insecure_channel(child_address), foreign):
            async with refused:
                with pytest.raises(grpc.aio.AioRpcError) as handshake:
                    await health_pb2_grpc.HealthStub(refused).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=5
                    )
            assert handshake.value.code() is grpc.StatusCode.UNAVAILABLE
    async with reader_of(cluster) as reader:
        accepted = [m.content for m in messages(await reader.transcript(child))]
    assert accepted == [m.content for m in messages(before)]  # nothing was accepted
    # Only the nodes reach the bed's etcd, each within its prefix (ADR 0032): a client
    # certificate of the same CA is refused every request there.
    reader_config = cluster.settings.etcd_config()
    assert reader_config.tls is not None
    as_client = replace(
        reader_config,
        call_timeout=timedelta(seconds=3),
        tls=replace(pki.client("tester").etcd_tls(), server_name=reader_config.tls.server_name),
    )
    async with Etcd(as_client) as etcd:
        with pytest.raises(Rejected) as refused:
            await etcd.get(cluster.settings.key_prefix.encode() + b"headers/" + root.encode())
    assert "user name not found" in str(refused.value) or "permission denied" in str(refused.value)


async def test_a_cut_off_host_loses_its_lease_and_its_child_resumes_on_another_host(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    cluster = start_cluster("CRASH")
    ttl = cluster.settings.lease_ttl
    async with reader_of(cluster) as reader:
        root, child = await started_child(cluster, reader)
        parent, root_host = await live_ref(reader, root)
        before = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Acknowledged before the cut.", key="before",
        )  # fmt: skip
        _, child_node = await live_ref(reader, child)
        assert child_node != root_host
        host = cluster.host_of(child_node).name
        first_lease = (await leases(cluster, reader))[child_node]

        cut_at = time.monotonic()
        bed.cut(host)
        await reader.wait_for(
            lambda: reader.activation(child), lambda a: a is None, what="the lease's expiry"
        )
        expired = time.monotonic() - cut_at
        at_root = await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="the lost notice"
        )
        noticed = time.monotonic() - cut_at
        (notice,) = notices(at_root)
        assert notice.outcome is SettlementOutcome.LOST
        assert notice.terminal_output == "Found 3 leases so far."
        # The parent's next message reaches the child on a host that is still there: the
        # message cold-resumes it, or it was already woken to read the message the cut left
        # unread (ADR 0043), placed by whichever node found its end (the root's host too).
        after = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Resume and finish.", key="after",
        )  # fmt: skip
        resumed = await reader.activation(child)
        live = time.monotonic() - cut_at
        assert resumed is not None and resumed.node_id != child_node
        assert after.target_activation_id == resumed.activation_id
        print(
            f"\ncut-off host {host} ({child_node}), lease TTL {ttl:.1f} s: its lease expired "
            f"after {expired:.2f} s, the parent had the lost notice after {noticed:.2f} s, and "
            f"the child was live on {resumed.node_id} after {live:.2f} s"
        )
        finished = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda r: len(notices(r)) == 2,
            what="the resumed child settled",
        )
        assert notices(finished)[1].outcome is SettlementOutcome.COMPLETED
        records = await reader.transcript(child)
        consumed = {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
        assert {before.accepted_seq, after.accepted_seq} <= consumed  # nothing acknowledged lost

        # The host comes back: its node notices it was fenced, registers with a new lease and
        # serves again; the agent it had when it was cut never appended after the cut.
        bed.restore(host)
        node_key = reader.keys.node(NodeId(child_node))
        async with Etcd(cluster.settings.etcd_config()) as etcd:
            again = await reader.wait_for(
                lambda: patiently(lambda: etcd.get(node_key)),
                lambda kv: kv is not None and int(kv.lease) != first_lease,
                what="the re-registration",
            )
        assert again is not None
        assert child_node in fenced(cluster)
        assert await health(cluster, child_node) == health_pb2.HealthCheckResponse.SERVING
        records = await reader.transcript(child)
        slow_steps = [
            r
            for r in records
            if isinstance(r.entry, AssistantStepEntry) and r.entry.text == "Slow step finished."
        ]
        assert len(slow_steps) == 1  # the resumed activation's; the cut-off agent wrote none
        # Serving again: a root on the returned host gets a child on another host, whose first
        # message crosses back to it.
        second_root = await create_root(cluster, on=child_node, task="Delegate again.")
        (second_child,) = await reader.wait_for(
            lambda: children_of(reader, second_root), lambda c: len(c) == 1, what="a child"
        )
        await reader.wait_for(
            lambda: reader.transcript(second_root),
            lambda r: [m.content for m in messages(r)] == ["Started."],
            what="the new child's message at the returned host",
        )
        _, second_host = await live_ref(reader, second_child.session_id)
        assert second_host != child_node


async def test_one_etcd_member_stopped_changes_nothing_visible(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    cluster = start_cluster("EXCHANGE")
    async with reader_of(cluster) as reader:
        held = await leases(cluster, reader)
        leader = await asyncio.to_thread(bed.etcd_leader)
        follower = next(name for name in sorted(bed.etcd) if name != leader)
        await asyncio.to_thread(bed.stop_etcd, follower)
        # The node on that host loses its own member and carries on with another one; a root
        # on it and a root elsewhere (whose child lands on it or on the third host).
        outcomes = [
            await exchange(cluster, reader, on=on, completed=False)
            for on in (f"node-{follower}", "node-a" if follower != "a" else "node-b")
        ]
        assert await leases(cluster, reader) == held  # no node lost its lease
        for node in cluster.nodes:
            assert await health(cluster, node) == health_pb2.HealthCheckResponse.SERVING
    assert fenced(cluster) == []
    await asyncio.to_thread(bed.start_etcd, follower)
    # The directory reloads on reconnect and notices are re-routed from etcd's own answer, so a
    # child settling while its node's member is away is still reported completed.
    assert outcomes == [SettlementOutcome.COMPLETED] * 2


async def test_killing_the_etcd_leader_costs_at_most_a_short_pause(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    cluster = start_cluster("TREE")  # every agent stays resident: sends steer a stalled child
    async with reader_of(cluster) as reader:
        root = await create_root(cluster, on="node-a", task="Build a tree.")
        children = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 3, what="the root's children"
        )
        target = children[0].session_id  # a continuable branch, on another host
        await reader.wait_for(
            lambda: reader.activation(target), lambda a: a is not None, what="the branch"
        )
        parent, root_host = await live_ref(reader, root)
        held = await leases(cluster, reader)

        latencies: list[float] = []
        retries = 0

        async def send(index: int) -> None:
            nonlocal retries
            key = f"tick-{index}-{secrets.token_hex(4)}"
            started = time.monotonic()
            while True:
                try:
                    await send_as(
                        cluster, via=root_host, caller=root_host, sender=parent, target=target,
                        message=f"Tick {index}.", key=key,
                    )  # fmt: skip
                    break
                except MeshError as error:
                    if not getattr(error, "retryable", False):
                        raise
                    retries += 1  # the same key: a retry never duplicates
                    await asyncio.sleep(0.02)
            latencies.append(time.monotonic() - started)

        for index in range(10):
            await send(index)
        leader = await asyncio.to_thread(bed.etcd_leader)
        killed_at = time.monotonic()
        await asyncio.to_thread(bed.kill_etcd, leader)
        for index in range(10, 40):
            await send(index)
        window = time.monotonic() - killed_at
        new_leader = await asyncio.to_thread(bed.etcd_leader)
        assert new_leader != leader

        records = await reader.transcript(target)
        ticks = [m.content for m in messages(records) if m.content.startswith("Tick")]
        assert ticks == [f"Tick {i}." for i in range(40)]  # each once, in order
        assert await leases(cluster, reader) == held  # no node lost its lease
    assert fenced(cluster) == []
    after = latencies[10:]
    print(
        f"\netcd leader {leader} killed (election timeout {bed.election_ms} ms): new leader "
        f"{new_leader}; the slowest of 30 sends after the kill took {max(after) * 1000:.0f} ms "
        f"({retries} retries), median {sorted(after)[len(after) // 2] * 1000:.0f} ms, "
        f"median before the kill {sorted(latencies[:10])[5] * 1000:.0f} ms; "
        f"30 sends in {window:.2f} s"
    )
    # A short pause: well inside one lease TTL, so no lease was at risk.
    assert max(after) < cluster.settings.lease_ttl


async def test_a_delaying_lossy_proxy_in_front_of_a_node_loses_no_message(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    host_b = bed.hosts["b"]
    async with TcpProxy(
        listen=(bed.bridge_address, 0),
        upstream=(host_b.address, 0),  # node-b listens on its host at the proxy's port
        delay=0.02,
        jitter=0.01,
        loss=0.1,
        seed=11,
    ) as proxy:
        cluster = await asyncio.to_thread(
            start_cluster, "EXCHANGE", fronted={"node-b": (proxy.host, proxy.port)}
        )
        assert cluster["node-b"].address == proxy.address  # peers dial the proxy
        async with reader_of(cluster) as reader:
            # A root on node-b: every message to it crosses the proxy.
            await exchange(cluster, reader, on="node-b")
        assert proxy.stats.connections > 0 and proxy.stats.lost > 0
        started = time.monotonic()
        assert await health(cluster, "node-b") == health_pb2.HealthCheckResponse.SERVING
        shaped = time.monotonic() - started
        started = time.monotonic()
        behind = f"{host_b.address}:{proxy.port}"
        assert await health(cluster, "node-b", address=behind) == (
            health_pb2.HealthCheckResponse.SERVING
        )
        direct = time.monotonic() - started
    print(
        f"\nproxy in front of node-b (20 ms +0-10 ms each way, 10% loss, 200 ms retransmit): "
        f"health check {shaped * 1000:.0f} ms through it, {direct * 1000:.0f} ms direct; "
        f"{proxy.stats}"
    )
    assert fenced(cluster) == []


async def test_the_nodes_keep_their_transcripts_in_postgresql_on_the_database_host(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    assert bed.database is not None and bed.db_host is not None
    db_host = bed.db_host
    # A host of its own: no etcd member, no node.
    assert db_host.name not in bed.hosts and db_host.name not in bed.etcd
    assert any(bed.database.pid == pid for pid in bed.pids(db_host.name))
    cluster = start_cluster("EXCHANGE")
    dsn = cluster.settings.log_store
    assert dsn.startswith(f"postgresql://postgres@{db_host.address}:{bed.database.port}/")
    for node in cluster:
        assert isinstance(node, BedNode)
        assert f"log_store = {json.dumps(dsn)}" in node.config_path.read_text()
    async with reader_of(cluster) as reader:
        root = await create_root(cluster, on="node-a", task="Survey the stack.")
        transcript = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: bool(notices(records)),
            what="the child's settlement notice",
        )
    # What the nodes wrote is in the database, straight from the test process's connection.
    connection = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await connection.fetch(
            "SELECT seq, convert_from(data, 'UTF8') FROM entries WHERE session = $1 ORDER BY seq",
            root,
        )
    finally:
        await connection.close()
    assert [row[0] for row in rows][: len(transcript)] == [r.seq for r in transcript]
    assert "Survey the stack." in rows[0][1]


def reaches(bed: MultiHostBed, host: str, address: str, port: int) -> bool:
    """Whether a TCP connection from inside ``host``'s namespace to ``address:port`` opens
    within two seconds."""
    probe = f"import socket; socket.create_connection(({address!r}, {port}), 2).close()"
    try:
        bed.exec(host, sys.executable, "-c", probe)
    except BedError:
        return False
    return True


async def test_a_host_cut_from_etcd_still_reaches_the_database_and_nothing_else(
    bed: MultiHostBed, start_cluster: StartCluster, reader_of: Callable[[BedCluster], MeshReader]
) -> None:
    assert bed.database is not None and bed.db_host is not None
    cluster = start_cluster("EXCHANGE")
    database = (bed.db_host.address, bed.database.port)
    other = bed.hosts["a"]
    other_node = cluster["node-a"].address
    assert other_node is not None
    node_host, node_port = other_node.rpartition(":")[::2]
    async with reader_of(cluster) as reader:
        held = (await leases(cluster, reader))["node-b"]
        assert held is not None
        await asyncio.to_thread(bed.isolate_from_etcd, "b")
        assert bed.is_cut("b")
        try:
            assert await asyncio.to_thread(reaches, bed, "b", *database)
            assert not await asyncio.to_thread(reaches, bed, "b", other.address, 2379)
            assert not await asyncio.to_thread(reaches, bed, "b", node_host, int(node_port))
            # Its node loses its lease (no etcd quorum), although its log store is there.
            key = reader.keys.node(NodeId("node-b"))
            async with Etcd(cluster.settings.etcd_config()) as etcd:
                await reader.wait_for(
                    lambda: patiently(lambda: etcd.get(key)),
                    lambda kv: kv is None or int(kv.lease) != held,
                    what="node-b's registration to lapse",
                )
        finally:
            await asyncio.to_thread(bed.restore, "b")
        assert not bed.is_cut("b")
        assert await asyncio.to_thread(reaches, bed, "b", other.address, 2379)
        assert await asyncio.to_thread(reaches, bed, "b", *database)
    assert "node-b" in fenced(cluster)
