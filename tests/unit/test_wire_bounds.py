"""Bounds on every field a client sends, at the conversion layer and at each handler of the
control plane (ADR 0039, docs/limits.md): every id, key, name and reason of a request has a
bound, one past it is ``INVALID_ARGUMENT`` naming the field, and the refusal's status fits in
gRPC's trailers whatever was sent. (tests/integration/test_input_bounds.py states the same
against a node process and the web view.)"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    MAX_APPROVAL_REASON_CHARS,
    ApprovalStale,
    InvalidArgument,
    RejectionReason,
    parse_session_id,
)
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.transport import DETAILS_METADATA_KEY, ERROR_DOMAIN, to_rpc_status
from dsh_mesh.transport._control import MeshControlService
from dsh_mesh.transport._convert import (
    MAX_NAME_CHARS,
    MAX_STOP_REASON_CHARS,
    bounded_fields,
    check_bounds,
    json_fields,
)
from tests.unit.conftest import Aborted, ServicerContext, control, presets

TRAILERS_MAX = 8 * 1024
"""What gRPC peers accept of trailers by default."""
MB = 1024 * 1024

CONTENT = {
    ("SendMessageRequest", "message"),
    ("SubmitPromptRequest", "text"),
    ("CreateRootSessionRequest", "initial_task"),
}
"""Content fields: bounded by the node's ``max_message_chars`` where they are accepted."""

EXPECTED: dict[str, dict[str, int]] = {
    "SendMessageRequest": {
        "sender.session_id": 256,
        "sender.activation_id": 256,
        "agent_id": 256,
        "idempotency_key": 256,
    },
    "CreateRootSessionRequest": {
        "preset": MAX_NAME_CHARS,
        "model": MAX_NAME_CHARS,
        "request_id": 256,
        "node_id": 256,
        "namespace": 256,
    },
    "SubmitPromptRequest": {"session_id": 256, "idempotency_key": 256},
    "InterruptRequest": {"session_id": 256},
    "StopTreeRequest": {"session_id": 256, "reason": MAX_STOP_REASON_CHARS},
    "ReopenTreeRequest": {"session_id": 256},
    "GetSessionRequest": {"session_id": 256, "page_token": 256},
    "WatchSessionRequest": {"session_id": 256},
    "ListAgentsRequest": {
        "root_session_id": 256,
        "page_token": 256,
        "namespace": 256,
        "preset": 256,
        "session_id_prefix": 256,
    },
    "ResolveApprovalRequest": {
        "session_id": 256,
        "call_id": 256,
        "request_digest": 256,
        "reason": MAX_APPROVAL_REASON_CHARS,
    },
    "ListApprovalsRequest": {"root_session_id": 256},
    "ListPricesRequest": {},
}
"""The contract (stated in mesh.proto): the bound of each field, in characters."""


def client_requests() -> list[Descriptor]:
    """The request messages of every RPC a client (or a node, for AgentMesh) calls."""
    services = mesh_pb2.DESCRIPTOR.services_by_name
    return [m.input_type for s in ("AgentMesh", "MeshControl") for m in services[s].methods]


def string_fields(message: Descriptor, prefix: str = "") -> list[str]:
    found = []
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            found.append(prefix + field.name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
            found += string_fields(field.message_type, f"{prefix}{field.name}.")
    return found


def message_class(name: str) -> Any:
    return getattr(mesh_pb2, name)


def request_with(name: str, path: str, value: str) -> Any:
    request = message_class(name)()
    target = request
    *parents, leaf = path.split(".")
    for part in parents:
        target = getattr(target, part)
    setattr(target, leaf, value)
    return request


def test_every_string_field_a_client_sends_has_a_bound() -> None:
    for message in client_requests():
        kind = message_class(message.name)
        bounded = set(bounded_fields(kind)) | set(json_fields(kind))
        for path in string_fields(message):
            assert path in bounded or (message.name, path) in CONTENT, (
                f"{message.name}.{path} has no bound"
            )


def test_the_bounds_are_the_documented_ones() -> None:
    assert {m.name: dict(bounded_fields(message_class(m.name))) for m in client_requests()} == (
        EXPECTED
    )
    assert dict(json_fields(mesh_pb2.ResolveApprovalRequest)) == {"arguments_json": MB}


FIELDS = [
    (name, path, limit) for name, fields in EXPECTED.items() for path, limit in fields.items()
]


def status_of_refusal(error: InvalidArgument) -> status_pb2.Status:
    status = to_rpc_status(error)
    assert status.ByteSize() < TRAILERS_MAX // 2  # it rides in two trailers, and the message
    return status


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(FIELDS),
    over=st.one_of(st.integers(1, 10), st.just(MB)),
    char=st.sampled_from(["a", "é", "😀", "\x00", "\n"]),
)
def test_a_field_past_its_bound_is_refused_naming_it_and_at_its_bound_passes(
    case: tuple[str, str, int], over: int, char: str
) -> None:
    name, path, limit = case
    check_bounds(request_with(name, path, char * limit))
    with pytest.raises(InvalidArgument) as refused:
        check_bounds(request_with(name, path, char * (limit + over)))
    assert refused.value.metadata == {"field": path, "limit": "chars", "max": str(limit)}
    assert char * 20 not in refused.value.detail or len(refused.value.detail) < 200
    status_of_refusal(refused.value)


@pytest.mark.parametrize(
    ("arguments", "limit"),
    [
        ("[" * 100_000 + "]" * 100_000, "json_depth"),
        ('{"a":' * 65 + "1" + "}" * 65, "json_depth"),
        ('"' + "x" * MB + '"', "json_bytes"),
    ],
    ids=["100000-deep", "65-deep", "over-1-mib"],
)
def test_an_edit_too_deep_or_too_large_is_refused_naming_arguments_json(
    arguments: str, limit: str
) -> None:
    request = mesh_pb2.ResolveApprovalRequest(arguments_json=arguments)
    with pytest.raises(InvalidArgument) as refused:
        check_bounds(request)
    assert refused.value.metadata["field"] == "arguments_json"
    assert refused.value.metadata["limit"] == limit
    status_of_refusal(refused.value)


def test_an_edit_at_its_bounds_passes() -> None:
    deepest = '{"a":' * 63 + "[1]" + "}" * 63
    check_bounds(mesh_pb2.ResolveApprovalRequest(arguments_json=deepest))
    largest = '"' + "x" * (MB - 2) + '"'
    check_bounds(mesh_pb2.ResolveApprovalRequest(arguments_json=largest))


def test_a_status_whose_metadata_echoes_a_megabyte_still_fits_the_trailers() -> None:
    """Whatever a raiser put in the metadata, the status that carries it keeps its reason."""
    error = ApprovalStale("no request waits", metadata={"call_id": "c" * MB})
    status = to_rpc_status(error, target="s-1")
    assert status.ByteSize() < TRAILERS_MAX // 2
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.metadata["target_session_id"]) == ("APPROVAL_STALE", "s-1")
    assert info.metadata["call_id"].startswith("c" * 64)


def test_a_refused_session_id_is_quoted_by_a_bounded_prefix() -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_session_id("s" * MB)
    assert len(refused.value.detail) < 200


# -- each handler of the control plane ------------------------------------------------------


def reason_and_info(status: Any) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo]:
    [value] = [v for k, v in status.trailing_metadata if k == DETAILS_METADATA_KEY]
    assert len(value) < TRAILERS_MAX
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(value).details[0].Unpack(info)
    assert info.domain == ERROR_DOMAIN
    return status.code, info


HANDLERS = [
    ("CreateRootSession", mesh_pb2.CreateRootSessionRequest(preset="lead"), "request_id"),
    ("SubmitPrompt", mesh_pb2.SubmitPromptRequest(text="hi", idempotency_key="k"), "session_id"),
    ("SubmitPrompt", mesh_pb2.SubmitPromptRequest(session_id="s-1", text="hi"), "idempotency_key"),
    ("Interrupt", mesh_pb2.InterruptRequest(), "session_id"),
    ("StopTree", mesh_pb2.StopTreeRequest(), "session_id"),
    ("ReopenTree", mesh_pb2.ReopenTreeRequest(), "session_id"),
    ("GetSession", mesh_pb2.GetSessionRequest(), "session_id"),
    ("ListAgents", mesh_pb2.ListAgentsRequest(), "page_token"),
    ("ListApprovals", mesh_pb2.ListApprovalsRequest(), "root_session_id"),
    (
        "ResolveApproval",
        mesh_pb2.ResolveApprovalRequest(
            session_id="s-1", decision=mesh_pb2.APPROVAL_DECISION_DENY, request_digest="d"
        ),
        "call_id",
    ),
    (
        "ResolveApproval",
        mesh_pb2.ResolveApprovalRequest(
            session_id="s-1",
            call_id="c",
            decision=mesh_pb2.APPROVAL_DECISION_EDIT,
            request_digest="d",
            arguments_json="[" * 100_000 + "]" * 100_000,
        ),
        "arguments_json",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "field"), HANDLERS, ids=[f"{m}-{f}" for m, _, f in HANDLERS]
)
async def test_each_control_handler_refuses_a_megabyte_field_as_invalid_argument_naming_it(
    method: str, request_: Any, field: str
) -> None:
    if field != "arguments_json":
        setattr(request_, field, "x" * MB)
    async with in_process_mesh(presets()) as mesh:
        service: MeshControlService = control(mesh)
        with pytest.raises(Aborted) as aborted:
            await getattr(service, method)(request_, ServicerContext())
    code, info = reason_and_info(aborted.value.status)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (info.reason, info.metadata["field"]) == (RejectionReason.INVALID_ARGUMENT.value, field)


async def test_watch_session_refuses_a_megabyte_session_id_naming_it() -> None:
    async with in_process_mesh(presets()) as mesh:
        service = control(mesh)
        with pytest.raises(Aborted) as aborted:
            async for _ in service.WatchSession(
                mesh_pb2.WatchSessionRequest(session_id="x" * MB), ServicerContext()
            ):
                pass
    code, info = reason_and_info(aborted.value.status)
    assert (code, info.metadata["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "session_id")
