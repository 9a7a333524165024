"""How the etcd facade sorts etcd's failures (no etcd needed): a request etcd refuses as
malformed is :class:`InvalidArgument` (retrying it unchanged fails again), an outage is a
retryable :class:`RegistryUnavailable`; and a revision etcd cannot name is refused before any
request is built (aetcd's shared watcher never recovers from a request it fails to build)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import aetcd.exceptions
import grpc
import pytest

from dsh_mesh.core import InvalidArgument, RegistryUnavailable
from dsh_mesh.registry import Etcd, EtcdConfig
from dsh_mesh.registry._etcd import MAX_REVISION, check_revision

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What grpc.aio raises when etcd answers ``code``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def raised_through_aetcd(error: grpc.aio.AioRpcError) -> aetcd.exceptions.ClientError:
    """aetcd's own exception for ``error``, with ``error`` as its cause (as aetcd raises it)."""
    try:
        aetcd.exceptions._handle_exception(error)
    except aetcd.exceptions.ClientError as wrapped:
        return wrapped
    raise AssertionError("aetcd raised nothing")


async def translated(error: BaseException) -> BaseException:
    etcd = Etcd(EtcdConfig(endpoint="127.0.0.1:1"))  # never dialled
    try:
        async with etcd._errors():
            raise error
    except Exception as seen:
        return seen
    finally:
        await etcd.close()
    raise AssertionError("nothing raised")


REFUSED = [
    (Code.INVALID_ARGUMENT, "etcdserver: request is too large", "too large for etcd"),
    (
        Code.RESOURCE_EXHAUSTED,
        "grpc: received message larger than max (3000023 vs. 2097152)",
        "too large for etcd",
    ),
    (Code.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request", "duplicate key"),
    (Code.INVALID_ARGUMENT, "etcdserver: too many operations in txn request", "too many"),
]
OUTAGES = [
    (Code.UNAVAILABLE, "failed to connect to all addresses"),
    (Code.DEADLINE_EXCEEDED, "Deadline Exceeded"),
    (Code.RESOURCE_EXHAUSTED, "etcdserver: too many requests"),
    (Code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"),
    (Code.UNKNOWN, "etcdserver: leader changed"),
    (Code.CANCELLED, "Cancelled"),
    # An answer over this client's receive limit is etcd's (or the mesh's) fault, not the
    # request's: never INVALID_ARGUMENT (issue 18).
    (Code.RESOURCE_EXHAUSTED, "Received message larger than max (5242880 vs. 4194304)"),
    # The same, as C-core says it of a stream it removed (what the bench's unpaged read of
    # 100k keys got).
    (
        Code.RESOURCE_EXHAUSTED,
        "Stream removed (CLIENT: Received message larger than max (7500074 vs. 4194304))",
    ),
]


@pytest.mark.parametrize("wrap", [False, True], ids=["grpc", "aetcd"])
@pytest.mark.parametrize(("code", "details", "said"), REFUSED)
async def test_a_request_etcd_refuses_is_invalid(
    code: grpc.StatusCode, details: str, said: str, wrap: bool
) -> None:
    error = rpc_error(code, details)
    seen = await translated(raised_through_aetcd(error) if wrap else error)
    assert isinstance(seen, InvalidArgument), seen
    assert said in str(seen) and not seen.retryable


@pytest.mark.parametrize("wrap", [False, True], ids=["grpc", "aetcd"])
@pytest.mark.parametrize(("code", "details"), OUTAGES)
async def test_an_outage_stays_unavailable(code: grpc.StatusCode, details: str, wrap: bool) -> None:
    error = rpc_error(code, details)
    seen = await translated(raised_through_aetcd(error) if wrap else error)
    assert isinstance(seen, RegistryUnavailable), seen
    assert seen.retryable


@pytest.mark.parametrize(
    "error",
    [ConnectionRefusedError("refused"), aetcd.exceptions.ConnectionFailedError("gone")],
    ids=["os", "aetcd"],
)
async def test_a_connection_failure_stays_unavailable(error: BaseException) -> None:
    assert isinstance(await translated(error), RegistryUnavailable)


async def test_a_compacted_revision_passes_through_for_the_directory() -> None:
    compacted = aetcd.exceptions.RevisionCompactedError(7)
    assert await translated(compacted) is compacted


@pytest.mark.parametrize("revision", [0, 1, MAX_REVISION])
def test_revisions_etcd_can_name_pass(revision: int) -> None:
    assert check_revision(revision) == revision


@pytest.mark.parametrize("revision", [-1, MAX_REVISION + 1, 2**64 - 1, 2**64])
def test_revisions_etcd_cannot_name_are_invalid(revision: int) -> None:
    with pytest.raises(InvalidArgument, match=str(revision)):
        check_revision(revision)


class Untouchable:
    """Stands in for the aetcd client: any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"aetcd was asked for {name!r}")


@pytest.mark.parametrize("start", [-1, MAX_REVISION + 1, 2**64 - 1])
async def test_a_watch_past_any_revision_never_reaches_aetcd(start: int) -> None:
    etcd = Etcd(EtcdConfig(endpoint="127.0.0.1:1"))
    real, etcd._client = etcd._client, Untouchable()
    try:
        with pytest.raises(InvalidArgument, match="start_revision"):
            async for _ in etcd.watch_prefix(b"/p/", start_revision=start):
                pass
        with pytest.raises(InvalidArgument, match="revision"):
            await etcd.range(b"/p/", revision=start)
    finally:
        etcd._client = real
        await etcd.close()


def test_connections_to_etcd_ping_so_a_vanished_member_is_left_in_seconds() -> None:
    """A member whose host is cut off sends no reset: without keepalive pings the connection
    stays "ready" and every call times out until the kernel gives up, minutes later (a fault
    run saw nodes unable to renew their leases for 35 s while two members served)."""
    config = EtcdConfig(endpoint="etcd-client:2379")
    options = config.channel_options()
    assert options["grpc.keepalive_time_ms"] == 5000  # etcd's --grpc-keepalive-min-time
    assert options["grpc.keepalive_timeout_ms"] == 2000
    assert Etcd(config)._client._options == options
    with pytest.raises(ValueError, match="keepalive"):
        EtcdConfig(keepalive=timedelta(0))


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (Code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"),
        (Code.UNAVAILABLE, "failed to connect to all addresses;\n last error: ECONNREFUSED"),
    ],
)
async def test_an_outage_reads_as_one_line_of_etcds_own_words(
    code: grpc.StatusCode, details: str
) -> None:
    """Issue 34: what a node logs and a client reads of an etcd failure is one readable line
    (the status and etcd's details), never gRPC's or aetcd's multi-line representation."""
    error = grpc.aio.AioRpcError(
        code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details,
        'UNKNOWN:Error received from peer  {grpc_status:8,\n created_time:"2026-12-06"}',
    )
    assert "\n" in str(error)  # what the message used to embed
    for raised in (error, raised_through_aetcd(error)):
        seen = await translated(raised)
        assert isinstance(seen, RegistryUnavailable)
        message = str(seen)
        assert "\n" not in message and "AioRpcError" not in message, message
        assert message.endswith(f"{code.name}: {' '.join(details.split())}"), message
