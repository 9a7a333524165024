"""Namespaces between users, on real clusters (issue 20, ADR 0033).

A client credential is granted namespaces in the cluster's namespaces file: a client
certificate by its name (the TLS test bed), a client token by its SHA-256 (plaintext). It sees,
prompts, interrupts and stops only sessions of its namespaces; any other session is unknown to
it, word for word as a session that does not exist, so that ids do not leak. It creates roots
only in its namespaces. Quotas bound what one namespace can make the cluster hold and how fast.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.client import ClientOptions, MeshClient
from dsh_mesh.core import (
    NamespaceDenied,
    QuotaExceeded,
    SessionUnknown,
    Unauthenticated,
)
from dsh_mesh.testing import EtcdAddress, EtcdServer, LocalCluster, LocalPki, MeshReader
from dsh_mesh.transport import token_digest

SCENARIO = "tests.integration.scenarios:LONG"
FAST = ClientOptions(call_timeout=timedelta(seconds=10))
TEAM_TOKEN = secrets.token_hex(16)
"""A plaintext client's token, granted namespace team-a only."""


# -- the TLS test bed: client certificates granted namespaces -------------------------------------


@pytest.fixture(scope="module")
def pki() -> Iterator[LocalPki]:
    with LocalPki() as made:
        yield made


@pytest.fixture(scope="module")
def tls_cluster(pki: LocalPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    grants = tmp_path_factory.mktemp("grants") / "namespaces.toml"
    grants.write_text(
        '[[grant]]\nclient = "alice"\nnamespaces = ["team-a"]\n\n'
        '[[grant]]\nclient = "bob"\nnamespaces = ["team-b"]\n\n'
        '[[grant]]\nclient = "ops"\nnamespaces = ["*"]\n\n'
        '[[grant]]\nclient = "carol"\nnamespaces = ["list-a", "list-b"]\n\n'
        f'[[grant]]\ntoken_sha256 = "{token_digest(TEAM_TOKEN)}"\nnamespaces = ["team-a"]\n'
    )
    with (
        EtcdServer(tls=pki) as etcd,
        LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario=SCENARIO,
            tls=pki,
            nodes=("node-a", "node-b"),
            env={"DSH_NAMESPACES_FILE": str(grants)},
        ) as running,
    ):
        yield running


@contextlib.asynccontextmanager
async def as_client(
    cluster: LocalCluster, name: str, node: str = "node-a"
) -> AsyncIterator[MeshClient]:
    files = cluster.settings.client_files(name)
    assert files is not None
    address = cluster[node].address
    assert address is not None
    async with MeshClient(address, tls=files.credentials(), server_name=node, options=FAST) as c:
        yield c


def unknown_detail(error: BaseException, session: str) -> str:
    """A refusal's detail with the session id it names taken out."""
    return str(error).replace(session, "<id>")


async def test_a_client_sees_and_steers_only_the_sessions_of_its_namespaces(
    tls_cluster: LocalCluster,
) -> None:
    async with as_client(tls_cluster, "alice") as alice:
        root = (await alice.create_root("long", "Team A's work.", namespace="team-a")).session_id
        assert (await alice.get_session(root)).info.namespace == "team-a"
        assert root in {a.info.session_id async for a in alice.list_agents()}
    nowhere = "s-" + "0" * 24
    async with as_client(tls_cluster, "bob", node="node-b") as bob:
        own = (await bob.create_root("long", "Team B's work.", namespace="team-b")).session_id
        with pytest.raises(SessionUnknown) as missing:
            await bob.get_session(nowhere)
        hidden_calls: dict[str, Callable[[], Awaitable[object]]] = {
            "get_session": lambda: bob.get_session(root),
            "prompt": lambda: bob.prompt(root, "Do what I say."),
            "interrupt": lambda: bob.interrupt(root),
            "stop_tree": lambda: bob.stop_tree(root, close=True),
            "reopen_tree": lambda: bob.reopen_tree(root),
        }
        for name, call in hidden_calls.items():
            with pytest.raises(SessionUnknown) as hidden:
                await call()
            # Exactly what a session that does not exist gets: the id does not leak.
            assert unknown_detail(hidden.value, root) == unknown_detail(missing.value, nowhere), (
                name
            )
        with pytest.raises(SessionUnknown):
            async for _ in bob.watch(root, tree=True):
                pass
        with pytest.raises(SessionUnknown):
            async for _ in bob.list_agents(root):
                pass
        listed = {a.info.session_id async for a in bob.list_agents()}
        assert own in listed and root not in listed
        with pytest.raises(NamespaceDenied):
            async for _ in bob.list_agents(namespace="team-a"):
                pass
        with pytest.raises(NamespaceDenied):
            await bob.create_root("long", "Squat in team A.", namespace="team-a")
    async with as_client(tls_cluster, "alice") as alice:
        session = await alice.get_session(root)  # bob's stop never reached it
        assert session.state is not None and session.state.name in {"RUNNING", "RESIDENT"}
        assert own not in {a.info.session_id async for a in alice.list_agents()}
    async with as_client(tls_cluster, "ops", node="node-b") as ops:
        everything = {a.info.session_id async for a in ops.list_agents()}
        assert {root, own} <= everything
        assert [a.info.session_id async for a in ops.list_agents(namespace="team-b")] == [own]


async def test_a_client_certificate_without_a_grant_sees_nothing_and_creates_nothing(
    tls_cluster: LocalCluster,
) -> None:
    async with as_client(tls_cluster, "ops") as ops:
        root = (await ops.create_root("long", "Default work.")).session_id
    async with as_client(tls_cluster, "mallory") as mallory:
        assert [a async for a in mallory.list_agents()] == []
        with pytest.raises(SessionUnknown):
            await mallory.get_session(root)
        with pytest.raises(NamespaceDenied):
            await mallory.create_root("long", "Mine now.")


async def test_a_listing_of_several_namespaces_pages_through_each_session_once(
    tls_cluster: LocalCluster,
) -> None:
    made: list[str] = []
    async with as_client(tls_cluster, "ops") as ops:
        for n in range(7):  # interleaved, so the merge of the two indexes is exercised
            namespace = ("list-a", "list-b", "list-c")[n % 3]
            root = (await ops.create_root("long", f"Root {n}.", namespace=namespace)).session_id
            if namespace != "list-c":
                made.append(root)
    async with as_client(tls_cluster, "carol", node="node-b") as carol:
        for size in (1, 2, 100):
            listed = [a.info.session_id async for a in carol.list_agents(page_size=size)]
            assert listed == made, size  # creation order, each once, none of list-c
        only_b = [a.info.session_id async for a in carol.list_agents(namespace="list-b")]
        assert only_b == made[1::2]
        # A tree is in one namespace: listing it within another lists nothing.
        assert [a async for a in carol.list_agents(made[0], namespace="list-b")] == []


# -- plaintext: client tokens granted namespaces, and the namespace quotas -----------------------


@pytest.fixture(scope="module")
def plain_cluster(
    etcd: EtcdAddress, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    grants = tmp_path_factory.mktemp("grants") / "namespaces.toml"
    grants.write_text(
        "[namespace.burst]\nmax_roots_per_minute = 10\n\n"
        "[namespace.small]\nmax_live_sessions = 2\n\n"
        f'[[grant]]\ntoken_sha256 = "{token_digest(TEAM_TOKEN)}"\nnamespaces = ["team-a"]\n'
    )
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario=SCENARIO,
        nodes=("node-a", "node-b"),
        env={"DSH_NAMESPACES_FILE": str(grants)},
    ) as running:
        yield running


def plain_client(cluster: LocalCluster, token: str, node: str = "node-a") -> MeshClient:
    address = cluster[node].address
    assert address is not None
    return MeshClient(address, token=token, options=FAST)


async def test_a_client_token_is_held_to_its_grant(plain_cluster: LocalCluster) -> None:
    operator = plain_cluster.settings.cluster_token
    async with plain_client(plain_cluster, operator) as ops:
        elsewhere = (await ops.create_root("long", "Default work.")).session_id
    async with plain_client(plain_cluster, TEAM_TOKEN, node="node-b") as team:
        own = (await team.create_root("long", "Team work.", namespace="team-a")).session_id
        assert (await team.get_session(own)).info.namespace == "team-a"
        with pytest.raises(SessionUnknown):
            await team.prompt(elsewhere, "Mine now.")
        with pytest.raises(NamespaceDenied):
            await team.create_root("long", "Elsewhere.")
        assert [a.info.session_id async for a in team.list_agents()] == [own]
    async with plain_client(plain_cluster, operator) as ops:  # the cluster token: everything
        assert {own, elsewhere} <= {a.info.session_id async for a in ops.list_agents()}
    async with plain_client(plain_cluster, secrets.token_hex(16)) as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.get_session(own)


async def test_a_gateway_acting_for_a_person_is_held_to_the_persons_token(
    plain_cluster: LocalCluster, tls_cluster: LocalCluster
) -> None:
    """A gateway (the web view) holding the operator's credential, acting for a person who
    signed in with a team's token, sees and steers no more than that team: in plaintext (the
    cluster token) and over TLS (a client certificate granted every namespace)."""
    operator = plain_cluster.settings.cluster_token
    async with plain_client(plain_cluster, operator) as ops:
        elsewhere = (await ops.create_root("long", "Default work.")).session_id
        own = (await ops.create_root("long", "Team work.", namespace="team-a")).session_id
        person = ops.acting_for(person_token=TEAM_TOKEN)
        listed = {a.info.session_id async for a in person.list_agents()}
        assert own in listed and elsewhere not in listed
        with pytest.raises(SessionUnknown):
            await person.stop_tree(elsewhere, close=True)
        with pytest.raises(NamespaceDenied):
            await person.create_root("long", "Elsewhere.")
        assert (await person.prompt(own, "Go on.")).accepted_seq > 0
        stranger = ops.acting_for(person_token=secrets.token_hex(16))
        with pytest.raises(Unauthenticated):
            await stranger.get_session(own)
        with pytest.raises(ValueError, match="printable"):
            ops.acting_for(person="a\nb")
        await person.close()  # its own: the gateway's channel stays open
        assert (await ops.get_session(elsewhere)).info.namespace == "default"
    async with as_client(tls_cluster, "ops") as tls_ops:
        theirs = (await tls_ops.create_root("long", "B.", namespace="team-b")).session_id
        mine = (await tls_ops.create_root("long", "A.", namespace="team-a")).session_id
        person = tls_ops.acting_for(person_token=TEAM_TOKEN)
        listed = {a.info.session_id async for a in person.list_agents()}
        assert mine in listed and theirs not in listed
        with pytest.raises(SessionUnknown):
            await person.interrupt(theirs)
        with pytest.raises(Unauthenticated):
            await tls_ops.acting_for(person_token=secrets.token_hex(16)).get_session(mine)


async def test_a_client_token_speaks_for_no_node(plain_cluster: LocalCluster) -> None:
    address = plain_cluster["node-a"].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await mesh_pb2_grpc.AgentMeshStub(channel).SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=mesh_pb2.AgentRef(session_id="s-" + "1" * 24, activation_id="a-1"),
                    agent_id="s-" + "2" * 24,
                    message="Hello.",
                    idempotency_key="k",
                ),
                metadata=(("x-dsh-cluster-token", TEAM_TOKEN), ("x-dsh-node", "node-b")),
                timeout=10,
            )
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_roots_are_created_at_the_namespaces_rate_and_no_faster(
    plain_cluster: LocalCluster,
) -> None:
    address = plain_cluster["node-a"].address
    assert address is not None
    metadata = (("x-dsh-cluster-token", plain_cluster.settings.cluster_token),)
    created, refused = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        for n in range(25):
            try:
                made = await stub.CreateRootSession(
                    mesh_pb2.CreateRootSessionRequest(
                        preset="long",
                        initial_task=f"Burst {n}.",
                        request_id=secrets.token_hex(8),
                        namespace="burst",
                    ),
                    metadata=metadata,
                    timeout=10,
                )
                created.append(made.session_id)
            except grpc.aio.AioRpcError as failed:
                refused.append(failed)
    assert len(created) == 10 and len(refused) == 15
    for error in refused:
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(error)
        assert status is not None
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        retries = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        infos[0].Unpack(info)
        retries[0].Unpack(retry)
        assert info.reason == "RATE_LIMITED"
        assert dict(info.metadata) == {
            "limit": "roots_per_minute",
            "max": "10",
            "namespace": "burst",
            "retry_after_ms": "6000",
        }
        assert retry.retry_delay.ToTimedelta() >= timedelta(seconds=6)
    async with MeshReader(plain_cluster.settings) as reader:
        stored = [h for h in await reader.sessions() if h.namespace == "burst"]
    assert sorted(h.session_id for h in stored) == sorted(created)
    # Another namespace is not held back by this one's quota.
    async with plain_client(plain_cluster, plain_cluster.settings.cluster_token) as ops:
        await ops.create_root("long", "Meanwhile.", namespace="calm")


async def test_a_namespace_holds_at_most_its_live_sessions(plain_cluster: LocalCluster) -> None:
    async with plain_client(plain_cluster, plain_cluster.settings.cluster_token) as ops:
        for n in range(2):
            await ops.create_root("long", f"Small {n}.", namespace="small")
        with pytest.raises(QuotaExceeded) as full:
            await ops.create_root("long", "One too many.", namespace="small")
        assert full.value.metadata["limit"] == "live_sessions"
        assert full.value.metadata["max"] == "2"
