"""Bounds on what a client sends (ADR 0039, docs/limits.md), against a real node process and
the real web view (`dsh-mesh ui`): an over-long id or key, an approval edit nested 100,000
deep or over its size, and a web view request body nested that deep or over its size, are each
refused as `INVALID_ARGUMENT` (HTTP 400 from the web view) naming the field, with the reason
intact in the trailers; nothing is stored, the call still waits, the node stays up."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    ApprovalRequestEntry,
    HumanPromptEntry,
    InvalidArgument,
    SessionId,
    TurnEndedEntry,
)
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    WebView,
    create_root,
    web_view,
)
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV
from dsh_mesh.transport import DETAILS_METADATA_KEY, ERROR_DOMAIN, error_from_rpc
from tests.integration.scenarios import PROBE_PRESETS

MB = 1024 * 1024
DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested 100,000 deep (200 KB: under every size bound, so only the depth refuses it)."""
TRAILERS_MAX = 8 * 1024
"""What gRPC peers accept of trailers by default: a status past it is dropped."""


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("bounds")
    presets = folder / "presets.toml"
    presets.write_text(PROBE_PRESETS)
    gate = folder / "probe.gate"
    gate.touch()
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PROBE",
        presets_file=presets,
        nodes=("node-a",),
        env={LOG_ENV: str(folder / "probe.log"), GATE_ENV: str(gate)},
    ) as running:
        yield running


_WAITING: dict[int, tuple[SessionId, ApprovalRequestEntry]] = {}


@pytest.fixture
async def waiting(cluster: LocalCluster) -> tuple[SessionId, ApprovalRequestEntry]:
    """A root whose call waits for a person's approval, and its request: one per cluster,
    which every test leaves waiting."""
    known = _WAITING.get(id(cluster))
    if known is not None:
        return known
    root = await create_root(cluster, on="node-a", task="Probe, once allowed.", preset="gated")
    async with MeshReader(cluster.settings) as reader:
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: any(isinstance(r.entry, TurnEndedEntry) for r in rs),
            what="the turn stopped at the call",
        )
    [request] = [r.entry for r in records if isinstance(r.entry, ApprovalRequestEntry)]
    assert isinstance(request, ApprovalRequestEntry)
    known = _WAITING[id(cluster)] = (root, request)
    return known


async def refusal(cluster: LocalCluster, method: str, request: object) -> grpc.aio.AioRpcError:
    async with cluster.channel("node-a") as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await getattr(stub, method)(request, metadata=cluster.metadata("tester"), timeout=30)
    return refused.value


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The mesh's ``ErrorInfo`` of a refusal: it must have come through whole."""
    [trailer] = [v for k, v in error.trailing_metadata() or () if k == DETAILS_METADATA_KEY]
    assert isinstance(trailer, bytes) and len(trailer) < TRAILERS_MAX
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(trailer).details[0].Unpack(info)
    assert info.domain == ERROR_DOMAIN
    return info


def assert_invalid(error: grpc.aio.AioRpcError, field: str) -> error_details_pb2.ErrorInfo:
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    info = error_info(error)
    assert (info.reason, info.metadata["field"]) == ("INVALID_ARGUMENT", field)
    assert isinstance(error_from_rpc(error), InvalidArgument)
    assert len(error.details() or "") <= 600  # a bounded detail, never the value refused
    return info


async def still_waits(cluster: LocalCluster, root: SessionId, call_id: str) -> None:
    async with cluster.channel("node-a") as channel:
        listed = await mesh_pb2_grpc.MeshControlStub(channel).ListApprovals(
            mesh_pb2.ListApprovalsRequest(root_session_id=root),
            metadata=cluster.metadata("tester"),
            timeout=30,
        )
    assert [a.request.call_id for a in listed.approvals] == [call_id]


async def test_a_1_mb_call_id_is_invalid_argument_with_its_reason_intact_in_the_trailers(
    cluster: LocalCluster, waiting: tuple[SessionId, ApprovalRequestEntry]
) -> None:
    root, request = waiting
    error = await refusal(
        cluster,
        "ResolveApproval",
        mesh_pb2.ResolveApprovalRequest(
            session_id=root,
            call_id="c" * MB,
            decision=mesh_pb2.APPROVAL_DECISION_DENY,
            request_digest=request.digest,
        ),
    )
    info = assert_invalid(error, "call_id")
    assert (info.metadata["limit"], info.metadata["max"]) == ("chars", "256")
    assert "c" * 100 not in (error.details() or "")
    await still_waits(cluster, root, request.call_id)


@pytest.mark.parametrize(
    ("arguments", "limit"), [(DEEP, "json_depth"), ('"' + "x" * (2 * MB) + '"', "json_bytes")]
)
async def test_an_edit_nested_100000_deep_or_over_its_size_is_invalid_argument(
    cluster: LocalCluster,
    waiting: tuple[SessionId, ApprovalRequestEntry],
    arguments: str,
    limit: str,
) -> None:
    root, request = waiting
    error = await refusal(
        cluster,
        "ResolveApproval",
        mesh_pb2.ResolveApprovalRequest(
            session_id=root,
            call_id=request.call_id,
            decision=mesh_pb2.APPROVAL_DECISION_EDIT,
            request_digest=request.digest,
            arguments_json=arguments,
        ),
    )
    assert assert_invalid(error, "arguments_json").metadata["limit"] == limit
    await still_waits(cluster, root, request.call_id)


async def test_a_1_mb_idempotency_key_is_refused_and_nothing_is_stored(
    cluster: LocalCluster, waiting: tuple[SessionId, ApprovalRequestEntry]
) -> None:
    root, _ = waiting
    error = await refusal(
        cluster,
        "SubmitPrompt",
        mesh_pb2.SubmitPromptRequest(
            session_id=root, text="A prompt under a huge key.", idempotency_key="k" * MB
        ),
    )
    assert_invalid(error, "idempotency_key")
    async with MeshReader(cluster.settings) as reader:
        records = await reader.transcript(root)
    assert not [r for r in records if isinstance(r.entry, HumanPromptEntry)]


@pytest.fixture(scope="module")
def view(cluster: LocalCluster) -> Iterator[WebView]:
    address = cluster["node-a"].address
    assert address is not None
    with web_view(address, cluster.settings.cluster_token) as running:
        yield running


async def post_approval(view: WebView, root: SessionId, **body: object) -> httpx.Response:
    async with view.signed_in() as http:
        return await http.post(f"/api/sessions/{root}/approve", **body)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (DEEP.encode(), "body"),
        (b'{"call_id": "' + b"c" * (5 * MB) + b'"}', "body"),
    ],
    ids=["nested-100000-deep", "5-mib"],
)
async def test_a_web_view_body_too_deep_or_too_large_is_a_400_with_the_reason(
    cluster: LocalCluster,
    view: WebView,
    waiting: tuple[SessionId, ApprovalRequestEntry],
    body: bytes,
    field: str,
) -> None:
    root, request = waiting
    answer = await post_approval(
        view, root, content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400, answer.text[:300]
    refused = answer.json()
    assert refused["error"] == "INVALID_ARGUMENT"
    assert refused["metadata"]["field"] == field
    assert len(answer.content) < 2048
    await still_waits(cluster, root, request.call_id)


async def test_a_web_view_edit_nested_100000_deep_is_a_400_naming_the_arguments(
    cluster: LocalCluster, view: WebView, waiting: tuple[SessionId, ApprovalRequestEntry]
) -> None:
    root, request = waiting
    answer = await post_approval(
        view,
        root,
        json={"call_id": request.call_id, "request_digest": request.digest, "arguments_json": DEEP},
    )
    assert answer.status_code == 400, answer.text[:300]
    refused = answer.json()
    assert (refused["error"], refused["metadata"]["field"]) == (
        "INVALID_ARGUMENT",
        "arguments_json",
    )
    await still_waits(cluster, root, request.call_id)
