"""Edge values at the transport (the pure functions): hop counts, page tokens,
corrupt status details and the sender's trace context. tests/unit/test_wire_properties.py states
the same rules over arbitrary input."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from dsh_mesh import telemetry
from dsh_mesh.core import InvalidArgument, PeerUnavailable, RejectionReason, TargetUnknown
from dsh_mesh.transport import DETAILS_METADATA_KEY, ERROR_DOMAIN, RemoteError, error_from_rpc
from dsh_mesh.transport._auth import HOPS_HEADER, caller_hops
from dsh_mesh.transport._control import DEFAULT_PAGE, MAX_PAGE_TOKEN_DIGITS, _page

TRACE = "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Context:
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


# -- x-dsh-hops ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "hops"),
    [
        (None, 0),
        ("0", 0),
        ("1", 1),
        ("007", 7),
        ("123456789", 123456789),
        ("1234567890", 0),  # longer than any count a node sends: ignored
        ("9" * 5000, 0),  # beyond Python's int() digit limit: ignored, not a crash
        ("0" * 5000, 0),
        ("", 0),
        ("-1", 0),
        ("+1", 0),
        (" 1", 0),
        ("abc", 0),
        ("\u00b2", 0),  # a digit to str.isdigit(), not to int()
        ("\u0663", 0),  # Arabic-Indic three
    ],
)
def test_a_hop_count_is_what_a_node_sends_or_ignored(sent: str | None, hops: int) -> None:
    metadata = [] if sent is None else [(HOPS_HEADER, sent)]
    assert caller_hops(_Context(metadata)) == hops


# -- page tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    ["\u00b2", "\u0663", "\uff11", "9" * 5000, "1" * 4301, "1" * (MAX_PAGE_TOKEN_DIGITS + 1)],
)
def test_a_page_token_no_server_issued_is_invalid_not_a_crash(token: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        _page(token, 0)
    assert len(str(refused.value)) < 200  # a huge token is not echoed whole


@pytest.mark.parametrize(
    ("token", "offset"),
    [("", 0), ("0", 0), ("42", 42), ("9" * MAX_PAGE_TOKEN_DIGITS, int("9" * 19))],
)
def test_a_decimal_page_token_is_an_offset(token: str, offset: int) -> None:
    assert _page(token, 0) == (offset, DEFAULT_PAGE)


# -- corrupt status details ---------------------------------------------------------------------


def _failed(code: grpc.StatusCode, *details: any_pb2.Any) -> grpc.aio.AioRpcError:
    status = status_pb2.Status(code=code.value[0], message="m", details=details)
    return grpc.aio.AioRpcError(
        code=code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata((DETAILS_METADATA_KEY, status.SerializeToString())),
        details="m",
    )


CORRUPT_INFO = any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff")


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.NOT_FOUND, RemoteError),
        (grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
    ],
)
def test_a_corrupt_error_info_falls_back_to_the_bare_code(
    code: grpc.StatusCode, kind: type[Exception]
) -> None:
    assert isinstance(error_from_rpc(_failed(code, CORRUPT_INFO)), kind)


def test_a_corrupt_error_info_does_not_hide_a_good_one_after_it() -> None:
    good = any_pb2.Any()
    good.Pack(
        error_details_pb2.ErrorInfo(
            reason=RejectionReason.UNKNOWN_TARGET.value, domain=ERROR_DOMAIN
        )
    )
    rebuilt = error_from_rpc(_failed(grpc.StatusCode.NOT_FOUND, CORRUPT_INFO, good))
    assert isinstance(rebuilt, TargetUnknown)


# -- the sender's trace context -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("carried", "stored"),
    [
        (f"00-{TRACE}", f"00-{TRACE}"),
        (f"01-{TRACE}", f"00-{TRACE}"),  # a later W3C version: its four fields, as version 00
        (f"cc-{TRACE}-extra", f"00-{TRACE}"),
        (f"ff-{TRACE}", ""),  # version ff is invalid
        (f"00-{TRACE}-extra", ""),  # version 00 has exactly four fields
        (f"00-{TRACE.upper()}", ""),
        (f"00-{'0' * 32}-b7ad6b7169203331-01", ""),
        ("not-a-trace", ""),
    ],
)
def test_the_sender_traceparent_is_a_version_00_one_or_nothing(carried: str, stored: str) -> None:
    """What a target stores with a message: never a value the transcript would refuse."""
    with telemetry.carrying_sender(carried):
        assert telemetry.sender_traceparent() == stored
