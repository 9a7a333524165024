"""Properties of the transport edge over arbitrary input (the unit half of the wire fuzzer,
tests/integration/test_wire_fuzz.py).

- A wire value becomes a domain value or a typed refusal (``InvalidArgument``), never another
  exception: a handler that let anything else escape would answer ``UNKNOWN``.
- Whatever a failed call carries (any code, any message, any trailer, corrupt details
  included), ``error_from_rpc`` rebuilds a ``MeshError``; it never raises.
- Every rejection survives the trailer with its class, reason and metadata whatever its detail
  and metadata hold (any Unicode, any length), the detail cut to ``MAX_DETAIL_BYTES`` of valid
  UTF-8. (tests/unit/test_status.py states the same for one fixed detail per reason.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from hypothesis import example, given
from hypothesis import strategies as st

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    InvalidArgument,
    MeshError,
    Rejected,
    RejectionReason,
    SessionId,
    SessionKind,
    SettlementOutcome,
)
from dsh_mesh.transport import (
    DETAILS_METADATA_KEY,
    ERROR_DOMAIN,
    MAX_DETAIL_BYTES,
    error_from_rpc,
    status_of,
    to_rpc_status,
)
from dsh_mesh.transport._auth import HOPS_HEADER, caller_hops
from dsh_mesh.transport._control import DEFAULT_PAGE, MAX_PAGE, _page
from dsh_mesh.transport._convert import agent_ref_from_wire, delivery_from_wire, notice_from_wire

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
TEXT = st.text(st.characters(codec="utf-8"), max_size=200)
"""Any string a protobuf string field can carry (UTF-8: no lone surrogates)."""
IDS = st.one_of(
    TEXT,
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,130}", fullmatch=True),
    st.sampled_from(["", "s-1", " s-1", "s-1\n", "a" * 128, "a" * 129, "\uff41", "s\u0301"]),
)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)


def is_session_id(text: str) -> bool:
    return _ID.fullmatch(text) is not None


# -- wire values become domain values or InvalidArgument ------------------------------------


@given(session_id=IDS, activation_id=TEXT)
def test_a_wire_sender_is_an_agent_ref_or_invalid(session_id: str, activation_id: str) -> None:
    wire = mesh_pb2.AgentRef(session_id=session_id, activation_id=activation_id)
    valid = is_session_id(session_id) and activation_id != ""
    try:
        ref = agent_ref_from_wire(wire)
    except InvalidArgument:
        assert not valid
        return
    assert valid
    assert (ref.session_id, ref.activation_id) == (session_id, activation_id)  # never trimmed


@given(
    parent=IDS,
    child=IDS,
    activation=TEXT,
    kind=st.one_of(st.sampled_from([k.value for k in SessionKind]), TEXT),
    outcome=st.one_of(st.sampled_from([o.value for o in SettlementOutcome]), TEXT),
    output=TEXT,
    detail=TEXT,
    trace=st.one_of(
        st.just(""), st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), TEXT
    ),
)
def test_a_wire_notice_is_a_notice_or_invalid(
    parent: str,
    child: str,
    activation: str,
    kind: str,
    outcome: str,
    output: str,
    detail: str,
    trace: str,
) -> None:
    request = peer_pb2.DeliverNoticeRequest(
        parent_session_id=parent,
        child_session_id=child,
        child_activation_id=activation,
        child_kind=kind,
        outcome=outcome,
        terminal_output=output,
        detail=detail,
        trace=trace,
    )
    try:
        got_parent, notice = notice_from_wire(request)
    except InvalidArgument:
        return
    assert got_parent == parent and is_session_id(parent) and is_session_id(child)
    assert (notice.child_session, notice.child_activation) == (child, activation)
    assert (notice.terminal_output, notice.detail) == (output, detail)


@given(delivery=st.integers(-(2**31), 2**31 - 1), seq=UINT64, activation=TEXT, dup=st.booleans())
def test_a_wire_acceptance_is_a_delivery_or_invalid(
    delivery: int, seq: int, activation: str, dup: bool
) -> None:
    response = mesh_pb2.SendMessageResponse(
        accepted_seq=seq, target_activation_id=activation, duplicate=dup
    )
    response.delivery = delivery  # type: ignore[assignment]  # an open enum: any int32 arrives
    try:
        got = delivery_from_wire(SessionId("s-1"), response)
    except InvalidArgument:
        assert delivery not in mesh_pb2.Delivery.values() or delivery == 0
        return
    assert (got.accepted_seq, got.target_activation, got.duplicate) == (seq, activation, dup)


@given(
    token=st.one_of(
        TEXT,
        st.integers(0, 10**30).map(str),
        st.sampled_from(["²", "٣", "\uff11", "9" * 4301, "0" * 5000, "-1", "+1", " 1", "1_000"]),
    ),
    size=UINT32,
)
@example(token="²", size=0)
@example(token="9" * 5000, size=0)
def test_a_page_token_is_an_offset_or_invalid(token: str, size: int) -> None:
    """A page token is opaque to clients: one the server did not issue is a malformed request
    (INVALID_ARGUMENT), whatever it holds, never a crash."""
    try:
        offset, limit = _page(token, size)
    except InvalidArgument:
        assert token != ""
        return
    assert offset >= 0 and 0 < limit <= MAX_PAGE
    assert limit == min(size or DEFAULT_PAGE, MAX_PAGE)
    assert token == "" or token.isdigit()


class _Context:
    """The part of a grpc.aio servicer context that ``caller_hops`` reads."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


@given(
    value=st.one_of(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
        st.integers(0, 10**40).map(str),
        st.integers(4000, 8000).map(lambda n: "9" * n),
    )
)
@example(value="9" * 5000)
def test_a_hop_count_is_a_count_whatever_a_caller_sends(value: str) -> None:
    """x-dsh-hops as any caller may send it (printable ASCII, what gRPC lets through):
    a count, never a crash."""
    hops = caller_hops(_Context([(HOPS_HEADER, value)]))
    assert isinstance(hops, int) and hops >= 0


# -- any failed call decodes to a MeshError -------------------------------------------------


def aio_error(
    code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, Any]]
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code=code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(*trailers),
        details=details,
    )


ANY_DETAIL = st.builds(
    any_pb2.Any,
    type_url=st.one_of(
        st.sampled_from(
            [
                "type.googleapis.com/google.rpc.ErrorInfo",
                "type.googleapis.com/google.rpc.RetryInfo",
                "type.googleapis.com/dsh.mesh.v1.Rejection",
            ]
        ),
        TEXT,
    ),
    value=st.one_of(
        st.binary(max_size=40),
        st.builds(
            lambda reason, domain: error_details_pb2.ErrorInfo(
                reason=reason, domain=domain
            ).SerializeToString(),
            st.one_of(st.sampled_from([r.value for r in RejectionReason]), TEXT),
            st.sampled_from([ERROR_DOMAIN, "example.com", ""]),
        ),
    ),
)


@st.composite
def trailers(draw: st.DrawFn, code: grpc.StatusCode) -> list[tuple[str, Any]]:
    kind = draw(st.sampled_from(["none", "garbage", "status"]))
    if kind == "none":
        return []
    if kind == "garbage":
        return [(DETAILS_METADATA_KEY, draw(st.binary(max_size=60)))]
    status = status_pb2.Status(
        code=draw(st.one_of(st.just(code.value[0]), st.integers(0, 20))),
        message=draw(TEXT),
        details=draw(st.lists(ANY_DETAIL, max_size=3)),
    )
    return [(DETAILS_METADATA_KEY, status.SerializeToString())]


@given(data=st.data(), code=st.sampled_from(list(grpc.StatusCode)), details=TEXT)
@example(data=None, code=grpc.StatusCode.NOT_FOUND, details="corrupt ErrorInfo")
def test_any_failed_call_decodes_to_a_mesh_error(
    data: st.DataObject | None, code: grpc.StatusCode, details: str
) -> None:
    if data is None:  # an ErrorInfo whose bytes are not one
        status = status_pb2.Status(code=code.value[0], message=details)
        status.details.append(
            any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff")
        )
        sent = [(DETAILS_METADATA_KEY, status.SerializeToString())]
    else:
        sent = data.draw(trailers(code))
    rebuilt = error_from_rpc(aio_error(code, details, sent))
    assert isinstance(rebuilt, MeshError)


@given(
    reason=st.sampled_from(list(RejectionReason)),
    detail=TEXT
    | st.builds(lambda unit, n: unit * n, st.sampled_from(["é", "😀", "a"]), st.integers(0, 3000)),
    metadata=st.dictionaries(TEXT, TEXT, max_size=3),
)
def test_every_rejection_survives_the_trailer_whatever_it_says(
    reason: RejectionReason, detail: str, metadata: dict[str, str]
) -> None:
    original = Rejected.of(reason, detail, metadata=metadata)
    status = to_rpc_status(original)
    assert status.code == status_of(reason).value[0]
    assert len(status.message.encode()) <= MAX_DETAIL_BYTES
    wire = rpc_status.to_status(status)
    rebuilt = error_from_rpc(aio_error(wire.code, wire.details, wire.trailing_metadata))
    assert type(rebuilt) is type(original)
    assert isinstance(rebuilt, Rejected)
    assert rebuilt.reason is reason
    assert dict(rebuilt.metadata) == metadata
    assert detail.startswith(rebuilt.detail)
    if len(f"{reason.value}: {detail}".encode()) <= MAX_DETAIL_BYTES:
        assert rebuilt.detail == detail
