"""Mutual TLS on real node processes and a real etcd with client-certificate authentication
(ADR 0021): messages cross nodes; the caller's identity is the one in its certificate, so a
forged sender, a client certificate speaking for an agent, a certificate of another CA, no
certificate at all and a certificate for another node name are all refused; a plaintext node
says so loudly."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.client import ClientOptions, MeshClient
from dsh_mesh.core import (
    AgentMessageEntry,
    AgentRef,
    Rejected,
    RejectionReason,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
)
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdTls
from dsh_mesh.registry._etcd import put
from dsh_mesh.testing import (
    EtcdAddress,
    EtcdServer,
    LocalCluster,
    LocalPki,
    MeshReader,
    TlsFiles,
    create_root,
)
from dsh_mesh.transport import TlsCredentials, error_from_rpc, secure_channel, status_of
from tests.integration.cli_process import Cli
from tests.integration.mesh_client import children_of, live_ref

FAST = ClientOptions(call_timeout=timedelta(seconds=10))


@pytest.fixture(scope="module")
def pki() -> Iterator[LocalPki]:
    with LocalPki() as opened:
        yield opened


@pytest.fixture(scope="module")
def tls_etcd(pki: LocalPki) -> Iterator[EtcdServer]:
    with EtcdServer(tls=pki) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(pki: LocalPki, tls_etcd: EtcdServer) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=tls_etcd.endpoint,
        scenario="tests.integration.scenarios:EXCHANGE",
        tls=pki,
    ) as running:
        yield running


@dataclass(frozen=True)
class Exchange:
    root: SessionId
    child: SessionId


_EXCHANGES: dict[str, Exchange] = {}


@pytest.fixture
async def reader(cluster: LocalCluster) -> AsyncIterator[MeshReader]:
    async with MeshReader(cluster.settings) as opened:
        yield opened


@pytest.fixture
async def exchange(cluster: LocalCluster, reader: MeshReader) -> Exchange:
    """The EXCHANGE scenario run once per module, through a MeshClient with a client
    certificate: a root on node-a, its worker on another node, the worker's settlement notice
    back at the root."""
    key = cluster.settings.key_prefix
    if key not in _EXCHANGES:
        files = cluster.settings.client_files("alice")
        assert files is not None
        node_a = cluster["node-a"].address
        assert node_a is not None
        async with MeshClient(
            node_a, tls=files.credentials(), server_name="node-a", options=FAST
        ) as client:
            root = (await client.create_root("lead", "Survey etcd over mutual TLS.")).session_id
        children = await reader.wait_for(
            lambda: children_of(reader, root), lambda found: len(found) == 1, what="the worker"
        )
        child = children[0].session_id
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: any(isinstance(r.entry, SettlementNoticeEntry) for r in records),
            what="the worker's settlement notice",
        )
        _EXCHANGES[key] = Exchange(root=root, child=child)
    return _EXCHANGES[key]


def _send_request(sender: AgentRef, target: str) -> mesh_pb2.SendMessageRequest:
    return mesh_pb2.SendMessageRequest(
        sender=mesh_pb2.AgentRef(session_id=sender.session_id, activation_id=sender.activation_id),
        agent_id=target,
        message="Are you still there?",
        idempotency_key=secrets.token_hex(8),
    )


async def _send(
    cluster: LocalCluster,
    *,
    via: str,
    as_files: TlsFiles,
    claim: str,
    sender: AgentRef,
    target: str,
) -> mesh_pb2.SendMessageResponse:
    """``SendMessage`` on node ``via`` over mutual TLS with the certificate ``as_files``,
    naming ``claim`` in ``x-dsh-node``; raises the decoded ``MeshError`` on refusal."""
    address = cluster[via].address
    assert address is not None
    async with secure_channel(address, as_files.credentials(), server_name=via) as channel:
        try:
            response: mesh_pb2.SendMessageResponse = await mesh_pb2_grpc.AgentMeshStub(
                channel
            ).SendMessage(
                _send_request(sender, target),
                metadata=(("x-dsh-node", claim), ("x-dsh-hops", "0")),
                timeout=30,
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
    return response


async def _health(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _assert_reason(error: Rejected, reason: RejectionReason, code: grpc.StatusCode) -> None:
    assert error.reason is reason, error
    assert status_of(reason) is code


# -- delivery -----------------------------------------------------------------------------------


async def test_messages_cross_nodes_under_mutual_tls(
    cluster: LocalCluster, reader: MeshReader, exchange: Exchange
) -> None:
    children = await children_of(reader, exchange.root)
    assert [c.session_id for c in children] == [exchange.child]
    at_root = await reader.transcript(exchange.root)
    messages = [r.entry for r in at_root if isinstance(r.entry, AgentMessageEntry)]
    assert [(m.source.sender_session_id, m.content) for m in messages] == [
        (exchange.child, "Progress: leases have a TTL."),
        (exchange.child, "Result: keys bound to an expired lease vanish."),
    ]
    notices = [r.entry for r in at_root if isinstance(r.entry, SettlementNoticeEntry)]
    assert notices[0].outcome is SettlementOutcome.COMPLETED
    at_child = await reader.transcript(exchange.child)
    assert [
        (r.entry.source.sender_session_id, r.entry.content)
        for r in at_child
        if isinstance(r.entry, AgentMessageEntry)
    ] == [(exchange.root, "Follow-up: what happens past the TTL?")]
    for node in cluster:
        assert "PLAINTEXT" not in node.log()


# -- refusals -----------------------------------------------------------------------------------


async def test_a_sender_not_hosted_by_the_certificate_that_called_is_forged(
    cluster: LocalCluster, reader: MeshReader, exchange: Exchange
) -> None:
    root, root_host = await live_ref(reader, exchange.root)
    impostor = next(node.node_id for node in cluster if node.node_id != root_host)
    before = await reader.transcript(exchange.child)
    with pytest.raises(Rejected) as caught:
        # Another node's genuine certificate, claiming (x-dsh-node) to be the sender's host.
        await _send(
            cluster,
            via=impostor,
            as_files=cluster.settings.tls.node(impostor),  # type: ignore[union-attr]
            claim=root_host,
            sender=root,
            target=exchange.child,
        )
    _assert_reason(caught.value, RejectionReason.FORGED_SENDER, grpc.StatusCode.PERMISSION_DENIED)
    assert await reader.transcript(exchange.child) == before


async def test_a_client_certificate_cannot_speak_for_an_agent(
    cluster: LocalCluster, reader: MeshReader, exchange: Exchange
) -> None:
    root, root_host = await live_ref(reader, exchange.root)
    client = cluster.settings.client_files("mallory")
    assert client is not None
    with pytest.raises(Rejected) as caught:
        await _send(
            cluster,
            via="node-b",
            as_files=client,
            claim=root_host,
            sender=root,
            target=exchange.child,
        )
    _assert_reason(caught.value, RejectionReason.FORGED_SENDER, grpc.StatusCode.PERMISSION_DENIED)
    # Nor may it call the node-to-node service.
    address = cluster["node-b"].address
    assert address is not None
    async with secure_channel(address, client.credentials(), server_name="node-b") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await peer_pb2_grpc.MeshPeerStub(channel).Activate(
                peer_pb2.ActivateRequest(session_id=exchange.child), timeout=10
            )
    error = error_from_rpc(refused.value)
    assert isinstance(error, Rejected) and error.reason is RejectionReason.FORGED_SENDER


async def test_an_etcd_member_certificate_is_neither_node_nor_client(
    cluster: LocalCluster, pki: LocalPki
) -> None:
    address = cluster["node-a"].address
    assert address is not None
    member = pki.etcd("etcd-dsh-test")  # signed by the cluster CA, but it names no caller
    async with secure_channel(address, member.credentials(), server_name="node-a") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await mesh_pb2_grpc.MeshControlStub(channel).ListAgents(
                mesh_pb2.ListAgentsRequest(), timeout=10
            )
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_a_certificate_of_another_ca_is_refused_at_the_handshake(
    cluster: LocalCluster,
) -> None:
    address = cluster["node-a"].address
    assert address is not None
    with LocalPki() as stranger:
        # A client certificate of another CA, trusting the right CA for the server.
        files = stranger.client("alice")
        credentials = TlsCredentials(
            cert_pem=files.cert.read_bytes(),
            key_pem=files.key.read_bytes(),
            ca_pem=cluster.settings.tls.ca.read_bytes(),  # type: ignore[union-attr]
        )
        async with secure_channel(address, credentials, server_name="node-a") as channel:
            assert await _health(channel) is grpc.StatusCode.UNAVAILABLE
        # A node certificate of another CA, for the right name, fares no better.
        forged = stranger.node("node-b")
        credentials = TlsCredentials(
            cert_pem=forged.cert.read_bytes(),
            key_pem=forged.key.read_bytes(),
            ca_pem=cluster.settings.tls.ca.read_bytes(),  # type: ignore[union-attr]
        )
        async with secure_channel(address, credentials, server_name="node-a") as channel:
            assert await _health(channel) is grpc.StatusCode.UNAVAILABLE


async def test_a_caller_without_a_certificate_is_refused(cluster: LocalCluster) -> None:
    address = cluster["node-a"].address
    assert address is not None
    ca = cluster.settings.tls.ca.read_bytes()  # type: ignore[union-attr]
    anonymous = grpc.ssl_channel_credentials(root_certificates=ca)
    async with grpc.aio.secure_channel(
        address, anonymous, options=[("grpc.ssl_target_name_override", "node-a")]
    ) as channel:
        assert await _health(channel) is grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(address) as channel:
        assert await _health(channel) is grpc.StatusCode.UNAVAILABLE


async def test_a_node_presenting_another_names_certificate_is_refused_when_dialed(
    cluster: LocalCluster,
) -> None:
    # What a node's PeerPool does: dial the address registered for node-a, expecting node-a.
    # The process there holds node-b's certificate, so the handshake fails.
    address_of_b = cluster["node-b"].address
    assert address_of_b is not None
    files = cluster.settings.client_files()
    assert files is not None
    credentials = files.credentials()
    async with secure_channel(address_of_b, credentials, server_name="node-a") as channel:
        assert await _health(channel) is grpc.StatusCode.UNAVAILABLE
    async with secure_channel(address_of_b, credentials, server_name="node-b") as channel:
        assert await _health(channel) is grpc.StatusCode.OK


STORE = ("--log-store", "sqlite:never-opened.db")


def _node(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # The store is named but never opened: these nodes are refused before they start.
        [sys.executable, "-m", "dsh_mesh.node", "--listen", "127.0.0.1:0", *STORE, *flags],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
    )


def test_a_node_with_a_certificate_for_another_name_does_not_start(
    cluster: LocalCluster, tls_etcd: EtcdServer
) -> None:
    files = cluster.settings.tls.node("node-b")  # type: ignore[union-attr]
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]
    started = _node("--node-id", "node-x", "--etcd", tls_etcd.endpoint, *tls)
    assert started.returncode == 2
    assert "node node-b's, not node node-x's" in started.stderr
    client = cluster.settings.client_files("carol")
    assert client is not None
    tls = ["--tls-cert", str(client.cert), "--tls-key", str(client.key), "--tls-ca", str(files.ca)]
    started = _node("--node-id", "carol", "--etcd", tls_etcd.endpoint, *tls)
    assert started.returncode == 2
    assert "not a node certificate" in started.stderr


def test_a_node_without_tls_or_an_explicit_plaintext_does_not_start() -> None:
    started = _node("--node-id", "node-z", "--cluster-token", "t" * 32)
    assert started.returncode == 2
    assert "TLS is required" in started.stderr
    assert "Traceback" not in started.stderr


def test_a_node_started_with_the_samples_placeholder_token_does_not_start() -> None:
    sample = Path(__file__).resolve().parents[2] / "nodes" / "node-a.toml"
    started = _node("--config", str(sample))
    assert started.returncode == 2
    assert "placeholder" in started.stderr and "secrets.token_hex(16)" in started.stderr
    assert "Traceback" not in started.stderr
    weak = _node("--node-id", "node-z", "--plaintext", "--cluster-token", "0123456789abcdef")
    assert weak.returncode == 2
    assert "too weak" in weak.stderr and "Traceback" not in weak.stderr


async def test_etcd_wants_a_client_certificate_of_the_cluster_ca(
    cluster: LocalCluster, tls_etcd: EtcdServer
) -> None:
    quick = timedelta(seconds=2)
    async with Etcd(cluster.settings.etcd_config()) as etcd:
        assert (await etcd.get_prefix(cluster.settings.key_prefix.encode())).kvs
    async with Etcd(EtcdConfig(endpoint=tls_etcd.endpoint, call_timeout=quick)) as plain:
        with pytest.raises(Rejected) as caught:
            await plain.get(b"/")
    assert caught.value.reason is RejectionReason.REGISTRY_UNAVAILABLE
    with LocalPki() as stranger:
        config = EtcdConfig(
            endpoint=tls_etcd.endpoint,
            call_timeout=quick,
            tls=stranger.client("x").etcd_tls(),
        )
        async with Etcd(config) as foreign:
            with pytest.raises(Rejected):
                await foreign.get(b"/")
    assert not EtcdAddress(host=tls_etcd.host, port=tls_etcd.port).is_healthy()
    assert tls_etcd.address.is_healthy()


# -- plaintext, asked for -------------------------------------------------------------------


def test_a_plaintext_node_warns_loudly(etcd: EtcdAddress) -> None:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:EXCHANGE",
        nodes=("node-p",),
    ) as plain:
        log = plain["node-p"].log()
    warning = next(line for line in log.splitlines() if "PLAINTEXT" in line)
    assert " WARNING " in warning
    assert "WITHOUT TLS" in warning and "node-p" in warning


# -- the command --------------------------------------------------------------------------------


def test_up_with_tls_serves_the_cli_over_mutual_tls(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_") and k != "NO_COLOR"}
    env["DSH_MESH_HOME"] = str(home)
    cli = Cli(env=env, cwd=tmp_path)
    with cli.start("up", "--tls", "--nodes", "2") as up:
        up.out.until(lambda line: line.startswith("ready"), within=45)
        state = json.loads((home / "cluster.json").read_text())
        assert state["cluster_token"] == "" and set(state["tls"]) == {"cert", "key", "ca"}
        assert oct((home / "certs" / "node-a.key").stat().st_mode & 0o777) == "0o600"
        status = cli.run("status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] and report["etcd"]["healthy"]
        spawned = cli.run("spawn", "--json", "Survey over TLS.")
        assert spawned.returncode == 0, spawned.stderr
        listed = cli.run("ls", "--json")
        assert listed.returncode == 0, listed.stderr
        # Without the state file's client certificate the CLI speaks plaintext: refused.
        address = state["nodes"][0]["address"]
        stranger = Cli(env={**env, "DSH_MESH_HOME": str(tmp_path / "elsewhere")}, cwd=tmp_path)
        refused = stranger.run("--node", address, "--deadline", "3", "ls")
        assert refused.returncode == 1
        assert "PEER_UNAVAILABLE" in refused.stderr
        # The CLI's certificate is the control plane's: etcd refuses it every request, so it
        # cannot forge what the nodes trust (ADR 0032), while the cluster runs on.
        pem = {name: Path(path).read_bytes() for name, path in state["tls"].items()}
        etcd_refusal = asyncio.run(_as_cli_in_etcd(state, pem))
        assert "user name not found" in etcd_refusal or "permission denied" in etcd_refusal
        assert cli.run("ls", "--json").returncode == 0


async def _as_cli_in_etcd(state: dict[str, Any], pem: dict[str, bytes]) -> str:
    """What etcd answers a write of a forged header made with the CLI's certificate."""
    tls = EtcdTls(ca_pem=pem["ca"], cert_pem=pem["cert"], key_pem=pem["key"])
    config = EtcdConfig(endpoint=state["etcd"], call_timeout=timedelta(seconds=3), tls=tls)
    forged = (state["key_prefix"] + "headers/s-forged").encode()
    async with Etcd(config) as etcd:
        with pytest.raises(Rejected) as refused:
            await etcd.txn([], [put(forged, b"{}")])
    return str(refused.value)


async def test_under_least_privilege_only_nodes_reach_etcd_each_within_its_prefix(
    pki: LocalPki,
) -> None:
    """ADR 0032: with etcd's auth on, a control-plane client certificate (the CLI's) is refused
    every etcd request, so it cannot forge headers, activations or entries; a node's certificate
    reads and writes its mesh's key prefix and nothing else; and the mesh works as before."""
    with (
        EtcdServer(tls=pki) as guarded,
        LocalCluster(
            etcd_endpoint=guarded.endpoint,
            scenario="tests.integration.scenarios:EXCHANGE",
            nodes=("node-a", "node-b"),
            tls=pki,
            least_privilege=True,
        ) as cluster,
    ):
        await create_root(cluster, on="node-a", task="Survey etcd leases.")
        async with MeshReader(cluster.settings) as reader:
            await reader.wait_for(reader.sessions, lambda s: len(s) == 2, what="root and child")
        prefix = cluster.settings.key_prefix.encode()
        quick = timedelta(seconds=3)

        def as_(files: TlsFiles) -> EtcdConfig:
            return EtcdConfig(endpoint=guarded.endpoint, call_timeout=quick, tls=files.etcd_tls())

        async with Etcd(as_(pki.client("tester"))) as client:
            for refused in (
                client.get(prefix + b"headers/s-any"),
                client.txn([], [put(prefix + b"headers/s-forged", b"{}")]),
            ):
                with pytest.raises(Rejected) as caught:
                    await refused
                assert "user name not found" in str(caught.value) or "permission denied" in str(
                    caught.value
                )
        async with Etcd(as_(pki.node("node-a"))) as node:
            await node.txn([], [put(prefix + b"probe", b"x")])
            assert (await node.get(prefix + b"probe")) is not None
            for outside in (
                node.txn([], [put(b"/elsewhere/x", b"x")]),
                node.get(b"/"),
                node.get_prefix(b"/"),
            ):
                with pytest.raises(Rejected) as caught:
                    await outside
                assert "permission denied" in str(caught.value)


GRANT_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "etcd" / "grant-mesh-access.sh"


async def test_the_deploy_script_grants_the_same_least_privilege_with_etcdctl(
    pki: LocalPki,
) -> None:
    """deploy/etcd/grant-mesh-access.sh, run as etcd's root user against a real etcd: the
    nodes named reach the prefix and nothing else, a client certificate nothing; a second run
    (a new node) keeps the first ones."""
    root = pki.node("root")
    quick = timedelta(seconds=3)
    with EtcdServer(tls=pki) as guarded:
        env = {
            **os.environ,
            "ETCDCTL_ENDPOINTS": f"https://{guarded.endpoint}",
            "ETCDCTL_CACERT": str(root.ca),
            "ETCDCTL_CERT": str(root.cert),
            "ETCDCTL_KEY": str(root.key),
        }
        for nodes in (["node-a", "node-b"], ["node-c"]):
            ran = await asyncio.to_thread(
                subprocess.run,
                ["bash", str(GRANT_SCRIPT), "/mesh/", *nodes],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert ran.returncode == 0, ran.stdout + ran.stderr

        def as_(files: TlsFiles) -> EtcdConfig:
            return EtcdConfig(endpoint=guarded.endpoint, call_timeout=quick, tls=files.etcd_tls())

        for node in ("node-a", "node-c"):
            async with Etcd(as_(pki.node(node))) as etcd:
                await etcd.txn([], [put(b"/mesh/" + node.encode(), b"x")])
                with pytest.raises(Rejected, match="permission denied"):
                    await etcd.txn([], [put(b"/other/x", b"x")])
        async with Etcd(as_(pki.client("admin"))) as admin:
            with pytest.raises(Rejected, match=r"user name not found|permission denied"):
                await admin.get(b"/mesh/node-a")
