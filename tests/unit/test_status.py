"""Every mesh error crosses the wire as one gRPC status with a machine-readable reason, and comes
back on the client as the same exception class with the same reason."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    RETRYABLE_REASONS,
    ActivationFenced,
    AdjacencyRejected,
    DeadlineExceeded,
    MeshError,
    NotResident,
    PeerUnavailable,
    Rejected,
    RejectionReason,
    SessionExists,
    SessionUnknown,
    TurnFailed,
    Unauthenticated,
    rejection_class,
    rejection_error,
)
from dsh_mesh.transport import (
    DETAILS_METADATA_KEY,
    ERROR_DOMAIN,
    MAX_DETAIL_BYTES,
    RETRY_DELAY,
    STATUS_OF_REASON,
    RemoteError,
    abort_with,
    error_from_rpc,
    status_of,
    to_rpc_status,
    wire_reason,
)
from dsh_mesh.transport._status import TARGET_KEY, target_of

PROTO = Path(__file__).resolve().parents[2] / "proto" / "dsh" / "mesh" / "v1" / "mesh.proto"
REASONS = list(RejectionReason)
REASON_IDS = [reason.value for reason in REASONS]


def documented_comments() -> dict[str, str]:
    """Map enum value name -> the comment block the proto puts above it."""
    documented: dict[str, str] = {}
    comment: list[str] = []
    for line in PROTO.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped.removeprefix("//").strip())
            continue
        value = re.match(r"REJECTION_REASON_([A-Z_]+)\s*=", stripped)
        if value and value.group(1) != "UNSPECIFIED":
            documented[value.group(1)] = " ".join(comment)
        comment = []
    return documented


def documented_status() -> dict[str, str]:
    """Map enum value name -> the 'Status X' its proto comment documents."""
    documented: dict[str, str] = {}
    for name, comment in documented_comments().items():
        found = re.search(r"Status ([A-Z_]+)", comment)
        assert found, f"{name} documents no status"
        documented[name] = found.group(1)
    return documented


@pytest.mark.contract(2)
def test_every_reason_has_the_status_the_proto_documents() -> None:
    documented = documented_status()
    assert set(documented) == {r.value for r in RejectionReason}
    for reason in RejectionReason:
        assert status_of(reason) is getattr(grpc.StatusCode, documented[reason.value]), reason


@pytest.mark.contract(2)
def test_every_reason_is_mapped_exactly_once() -> None:
    assert set(STATUS_OF_REASON) == set(RejectionReason)


# -- one reason, one class, one status ----------------------------------------------------------


@pytest.mark.parametrize("reason", REASONS, ids=REASON_IDS)
def test_every_reason_has_exactly_one_class_that_keeps_it(reason: RejectionReason) -> None:
    kind = rejection_class(reason)
    assert issubclass(kind, Rejected)
    error = Rejected.of(reason, "why", metadata={"target_session_id": "s-1"})
    assert type(error) is kind
    assert error.reason is reason
    assert error.detail == "why"
    assert dict(error.metadata) == {"target_session_id": "s-1"}
    assert str(error) == f"{reason.value}: why"
    assert wire_reason(error) is reason
    assert isinstance(status_of(reason), grpc.StatusCode)


def test_named_classes_carry_their_fixed_reason() -> None:
    assert rejection_class(RejectionReason.UNAUTHENTICATED) is Unauthenticated
    assert rejection_class(RejectionReason.PEER_UNAVAILABLE) is PeerUnavailable
    assert rejection_class(RejectionReason.DEADLINE_EXCEEDED) is DeadlineExceeded
    assert rejection_class(RejectionReason.UNKNOWN_SESSION) is SessionUnknown
    assert PeerUnavailable("gone").reason is RejectionReason.PEER_UNAVAILABLE
    # SessionUnknown is raised with just the session id and is a rejection (nothing changed).
    unknown = SessionUnknown("s-9")
    assert isinstance(unknown, Rejected)
    assert unknown.reason is RejectionReason.UNKNOWN_SESSION
    assert unknown.detail == "s-9"
    assert dict(unknown.metadata) == {}


def test_the_retryable_reasons_are_exactly_those_sent_as_unavailable_or_exhausted() -> None:
    transient = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
    unavailable = {r for r, code in STATUS_OF_REASON.items() if code in transient}
    assert unavailable == RETRYABLE_REASONS
    for reason in RejectionReason:
        assert Rejected.of(reason, "x").retryable is (reason in RETRYABLE_REASONS)


def test_the_proto_says_retryable_exactly_for_the_retryable_reasons() -> None:
    for name, comment in documented_comments().items():
        says = "Retryable (RetryInfo)" in comment
        assert says is (RejectionReason(name) in RETRYABLE_REASONS), name


# The reasons authorize() decides; core's rejection_error must raise the same class for them.
AUTHORIZATION_REASONS = [
    RejectionReason.SELF_TARGET,
    RejectionReason.SIBLING_TARGET,
    RejectionReason.ANCESTOR_BEYOND_EDGE,
    RejectionReason.DESCENDANT_BEYOND_EDGE,
    RejectionReason.UNRELATED_TARGET,
    RejectionReason.UNKNOWN_TARGET,
    RejectionReason.UNKNOWN_SENDER,
    RejectionReason.STALE_SENDER,
    RejectionReason.ONE_SHOT_TARGET,
    RejectionReason.ONE_SHOT_SENDER,
    RejectionReason.PARENT_NOT_LIVE,
    RejectionReason.PARENT_REBOUND,
    RejectionReason.FORGED_SENDER,
    RejectionReason.INVALID_ARGUMENT,
]


@pytest.mark.parametrize("reason", AUTHORIZATION_REASONS, ids=lambda r: r.value)
def test_authorization_raises_the_class_the_wire_rebuilds(reason: RejectionReason) -> None:
    assert type(rejection_error(reason, "why")) is rejection_class(reason)
    assert rejection_class(RejectionReason.FORGED_SENDER) is AdjacencyRejected


# -- the Status proto -----------------------------------------------------------------------


def unpack(status: Any, kind: type[Message]) -> list[Any]:
    found = []
    for detail in status.details:
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            found.append(message)
    return found


@pytest.mark.parametrize("reason", REASONS, ids=REASON_IDS)
def test_the_status_carries_error_info_rejection_and_retry_info_when_retryable(
    reason: RejectionReason,
) -> None:
    status = to_rpc_status(Rejected.of(reason, "why", metadata={"target_session_id": "s-1"}))
    assert status.code == status_of(reason).value[0]
    assert status.message == f"{reason.value}: why"
    [info] = unpack(status, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain) == (reason.value, ERROR_DOMAIN)
    assert dict(info.metadata) == {"target_session_id": "s-1"}
    [rejection] = unpack(status, mesh_pb2.Rejection)
    assert mesh_pb2.RejectionReason.Name(rejection.reason) == f"REJECTION_REASON_{reason.value}"
    assert (rejection.detail, rejection.target_session_id) == ("why", "s-1")
    retry = unpack(status, error_details_pb2.RetryInfo)
    if reason in RETRYABLE_REASONS:
        assert [r.retry_delay.ToTimedelta() for r in retry] == [RETRY_DELAY]
    else:
        assert retry == []


def test_node_local_fences_travel_as_peer_unavailable() -> None:
    for error in (ActivationFenced("s-1: writer a-1 is not current"), NotResident("s-1")):
        assert wire_reason(error) is RejectionReason.PEER_UNAVAILABLE
        status = to_rpc_status(error)
        assert status.code == grpc.StatusCode.UNAVAILABLE.value[0]
        [info] = unpack(status, error_details_pb2.ErrorInfo)
        assert info.reason == "PEER_UNAVAILABLE"
        assert unpack(status, error_details_pb2.RetryInfo)
        rebuilt = error_from_rpc(as_rpc_error(status))
        assert type(rebuilt) is PeerUnavailable
        assert type(error).__name__ in str(rebuilt)


@pytest.mark.parametrize("error", [SessionExists("s-1"), TurnFailed("model down"), MeshError("?")])
def test_a_mesh_error_without_a_reason_is_an_internal_fault_without_details(
    error: MeshError,
) -> None:
    assert wire_reason(error) is None
    status = to_rpc_status(error)
    assert status.code == grpc.StatusCode.INTERNAL.value[0]
    assert list(status.details) == []
    rebuilt = error_from_rpc(as_rpc_error(status))
    assert isinstance(rebuilt, RemoteError)
    assert rebuilt.code is grpc.StatusCode.INTERNAL
    assert type(error).__name__ in rebuilt.detail


def test_a_long_detail_is_cut_to_valid_utf8() -> None:
    status = to_rpc_status(Rejected.of(RejectionReason.INVALID_ARGUMENT, "é" * MAX_DETAIL_BYTES))
    assert len(status.message.encode()) <= MAX_DETAIL_BYTES
    [rejection] = unpack(status, mesh_pb2.Rejection)
    assert len(rejection.detail.encode()) <= MAX_DETAIL_BYTES
    assert set(rejection.detail) == {"é"}


# -- back from the wire -----------------------------------------------------------------------


def as_rpc_error(status: Any) -> grpc.aio.AioRpcError:
    """What grpc.aio raises on the client for a call the server ended with ``status``."""
    wire = rpc_status.to_status(status)
    return grpc.aio.AioRpcError(
        code=wire.code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(*wire.trailing_metadata),
        details=wire.details,
    )


class SyncRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What a synchronous stub raises: a grpc.RpcError that is also a grpc.Call."""

    def __init__(self, status: Any) -> None:
        self._wire = rpc_status.to_status(status)

    def code(self) -> grpc.StatusCode:
        return self._wire.code

    def details(self) -> str:
        return str(self._wire.details)

    def trailing_metadata(self) -> Any:
        return self._wire.trailing_metadata

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def assert_same(rebuilt: MeshError, original: Rejected) -> None:
    assert type(rebuilt) is type(original)
    assert isinstance(rebuilt, Rejected)
    assert rebuilt.reason is original.reason
    assert rebuilt.detail == original.detail
    assert dict(rebuilt.metadata) == dict(original.metadata)
    assert rebuilt.retryable is original.retryable


@pytest.mark.parametrize("reason", REASONS, ids=REASON_IDS)
def test_every_reason_round_trips_through_the_trailer(reason: RejectionReason) -> None:
    original = Rejected.of(
        reason, f"no {reason.value.lower()}", metadata={"target_session_id": "t"}
    )
    status = to_rpc_status(original)
    assert_same(error_from_rpc(as_rpc_error(status)), original)
    assert_same(error_from_rpc(SyncRpcError(status)), original)
    # grpc-status's own reader accepts what we send (code and message agree with the details).
    assert rpc_status.from_call(SyncRpcError(status)) == status


def test_a_remote_error_is_relayed_with_its_code_and_message() -> None:
    original = RemoteError(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max")
    rebuilt = error_from_rpc(as_rpc_error(to_rpc_status(original)))
    assert isinstance(rebuilt, RemoteError)
    assert (rebuilt.code, rebuilt.detail) == (original.code, original.detail)


def bare(code: grpc.StatusCode, details: str = "bare", trailers: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code=code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(*trailers),
        details=details,
    )


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    ],
)
def test_a_bare_status_is_typed_by_its_code(code: grpc.StatusCode, kind: type[Rejected]) -> None:
    rebuilt = error_from_rpc(bare(code, "connection refused"))
    assert type(rebuilt) is kind
    assert isinstance(rebuilt, Rejected)
    assert rebuilt.detail == "connection refused"


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNKNOWN]
)
def test_any_other_bare_status_is_a_remote_error_with_its_code(code: grpc.StatusCode) -> None:
    rebuilt = error_from_rpc(bare(code, "no such method"))
    assert isinstance(rebuilt, RemoteError)
    assert (rebuilt.code, rebuilt.detail) == (code, "no such method")


def foreign_status(code: grpc.StatusCode, info: Any) -> Any:
    status = status_pb2.Status(code=code.value[0], message="foreign")
    status.details.add().Pack(info)
    return status


def test_details_that_are_not_ours_fall_back_to_the_code() -> None:
    other_domain = foreign_status(
        grpc.StatusCode.NOT_FOUND,
        error_details_pb2.ErrorInfo(reason="UNKNOWN_TARGET", domain="example.com"),
    )
    rebuilt = error_from_rpc(as_rpc_error(other_domain))
    assert isinstance(rebuilt, RemoteError)
    assert rebuilt.code is grpc.StatusCode.NOT_FOUND

    newer_reason = foreign_status(
        grpc.StatusCode.UNAVAILABLE,
        error_details_pb2.ErrorInfo(reason="SOMETHING_ADDED_LATER", domain=ERROR_DOMAIN),
    )
    assert type(error_from_rpc(as_rpc_error(newer_reason))) is PeerUnavailable

    garbage = bare(grpc.StatusCode.UNAVAILABLE, trailers=[(DETAILS_METADATA_KEY, b"\xff\xfe")])
    assert type(error_from_rpc(garbage)) is PeerUnavailable


def test_details_whose_code_disagrees_with_the_call_are_ignored() -> None:
    status = to_rpc_status(Rejected.of(RejectionReason.SIBLING_TARGET, "why"))
    rewritten = bare(
        grpc.StatusCode.UNAVAILABLE,
        trailers=[(DETAILS_METADATA_KEY, status.SerializeToString())],
    )
    assert type(error_from_rpc(rewritten)) is PeerUnavailable


# -- against a real grpc.aio server on loopback ---------------------------------------------

SERVICE = "dsh.mesh.test.Errors"


async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """Abort with the rejection whose reason the request names, or crash on b"crash"."""
    name = request.decode()
    if name == "crash":
        raise RuntimeError("not a mesh error")
    reason = RejectionReason(name)
    await abort_with(context, Rejected.of(reason, f"because {name}", metadata={"k": name}))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Fail": grpc.unary_unary_rpc_method_handler(fail)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]
        ) as opened:
            yield opened
    finally:
        await server.stop(grace=None)


async def test_every_reason_round_trips_through_a_real_grpc_aio_server(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_unary(f"/{SERVICE}/Fail")
    for reason in RejectionReason:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(reason.value.encode(), timeout=10)
        assert caught.value.code() is status_of(reason)
        rebuilt = error_from_rpc(caught.value)
        assert_same(
            rebuilt, Rejected.of(reason, f"because {reason.value}", metadata={"k": reason.value})
        )


async def test_a_handler_crash_is_not_mapped_and_arrives_as_a_remote_error(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_unary(f"/{SERVICE}/Fail")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(b"crash", timeout=10)
    rebuilt = error_from_rpc(caught.value)
    assert isinstance(rebuilt, RemoteError)
    assert rebuilt.code is grpc.StatusCode.UNKNOWN  # grpc.aio's own answer to a crash


# -- the target a refusal names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_message", "target"),
    [
        (mesh_pb2.SendMessageRequest(agent_id="s-2"), "s-2"),
        (mesh_pb2.SubmitPromptRequest(session_id="s-3"), "s-3"),
        (mesh_pb2.InterruptRequest(session_id="s-4"), "s-4"),
        (mesh_pb2.GetSessionRequest(session_id="s-5"), "s-5"),
        (mesh_pb2.WatchSessionRequest(session_id="s-6"), "s-6"),
        (mesh_pb2.ListAgentsRequest(root_session_id="s-7"), "s-7"),
        (mesh_pb2.ListAgentsRequest(), ""),
        (mesh_pb2.CreateRootSessionRequest(request_id="r-1"), ""),
        # Never echoed: a malformed id (here too long for a session id) could fill the trailer.
        (mesh_pb2.SendMessageRequest(agent_id="s" * 10_000), ""),
        (mesh_pb2.GetSessionRequest(session_id="bad id"), ""),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Message) else repr(value)[:12],
)
def test_the_target_of_a_request_is_the_session_it_names(
    request_message: Message, target: str
) -> None:
    assert target_of(request_message) == target


@pytest.mark.parametrize("reason", REASONS, ids=REASON_IDS)
def test_a_refusal_names_the_target_of_the_refused_request(reason: RejectionReason) -> None:
    status = to_rpc_status(Rejected.of(reason, "why"), target="s-2")
    [info] = unpack(status, error_details_pb2.ErrorInfo)
    [rejection] = unpack(status, mesh_pb2.Rejection)
    assert dict(info.metadata)[TARGET_KEY] == "s-2"
    assert rejection.target_session_id == "s-2"
    # A target the error names itself (a forwarded refusal) is kept.
    named = Rejected.of(reason, "why", metadata={TARGET_KEY: "s-9"})
    [rejection] = unpack(to_rpc_status(named, target="s-2"), mesh_pb2.Rejection)
    assert rejection.target_session_id == "s-9"


def test_a_fault_names_no_target() -> None:
    status = to_rpc_status(TurnFailed("boom"), target="s-2")
    assert status.code == grpc.StatusCode.INTERNAL.value[0]
    assert list(status.details) == []
