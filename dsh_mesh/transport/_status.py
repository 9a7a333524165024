"""The one table between mesh errors and gRPC statuses, used on both sides of the wire.

Server side: a handler that catches a :class:`~dsh_mesh.core.MeshError` ends the call with
``await abort_with(context, error)``. The status code comes from :data:`STATUS_OF_REASON`; the
status details (trailer ``grpc-status-details-bin``, a serialized ``google.rpc.Status``) carry,
in this order, a ``google.rpc.ErrorInfo`` (``reason`` = the :class:`RejectionReason` value name,
``domain`` = :data:`ERROR_DOMAIN`, ``metadata`` = the error's structured fields), a
``dsh.mesh.v1.Rejection`` (the same reason as the proto enum) and, for retryable reasons only, a
``google.rpc.RetryInfo`` (:data:`RETRY_DELAY`). Exceptions that are not ``MeshError`` are never
mapped here: grpc.aio itself ends the call with ``UNKNOWN`` ("Unexpected <class ...>").

Client side: ``except grpc.RpcError as e: raise error_from_rpc(e) from e`` rebuilds the same
exception class with the same reason (the one :func:`~dsh_mesh.core.rejection_class` names), so a
forwarding node re-raises exactly what the target node raised. Always chain with ``from``: the
original ``RpcError`` keeps the peer's debug string.

The human table of all of this is ``docs/errors.md``; a test keeps it equal to this module.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    RETRYABLE_REASONS,
    ActivationFenced,
    InvalidArgument,
    MeshError,
    NotResident,
    Rejected,
    RejectionReason,
    parse_session_id,
)

ERROR_DOMAIN = "dsh.mesh.v1"
"""``google.rpc.ErrorInfo.domain`` of every mesh rejection; other domains are not ours."""

RETRY_DELAY = timedelta(milliseconds=200)
"""``RetryInfo.retry_delay`` sent with every retryable reason: the least a client should wait."""

RETRY_AFTER_KEY = "retry_after_ms"
"""ErrorInfo metadata a rejection may carry to ask for a longer ``RetryInfo`` delay than
:data:`RETRY_DELAY` (``RATE_LIMITED`` does: when its window has room again)."""

MAX_DETAIL_BYTES = 512
"""The human-readable detail is cut to this many UTF-8 bytes on the wire. It appears in the
``grpc-message`` header and twice inside ``grpc-status-details-bin``; gRPC peers refuse trailers
over about 8 KiB by default, so an unbounded detail could turn a clean rejection into a transport
error."""

MAX_METADATA_BYTES = 256
"""Each key and value of a rejection's ``ErrorInfo`` metadata is cut to this many UTF-8 bytes
on the wire. The mesh's own values (ids, limits, names) are shorter: request fields are
bounded before anything can echo them (ADR 0039); this keeps a status that would echo a
caller's value anyway within the trailers, so its reason is never dropped."""

DETAILS_METADATA_KEY = "grpc-status-details-bin"
"""The trailer that carries the serialized ``google.rpc.Status`` (the gRPC convention)."""

STATUS_OF_REASON: Mapping[RejectionReason, grpc.StatusCode] = MappingProxyType(
    {
        RejectionReason.SELF_TARGET: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.SIBLING_TARGET: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.ANCESTOR_BEYOND_EDGE: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.DESCENDANT_BEYOND_EDGE: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.UNRELATED_TARGET: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.UNKNOWN_TARGET: grpc.StatusCode.NOT_FOUND,
        RejectionReason.UNKNOWN_SENDER: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.STALE_SENDER: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.ONE_SHOT_TARGET: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.ONE_SHOT_SENDER: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.PARENT_NOT_LIVE: grpc.StatusCode.UNAVAILABLE,
        RejectionReason.PARENT_REBOUND: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.FORGED_SENDER: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
        RejectionReason.IDEMPOTENCY_CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
        RejectionReason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
        RejectionReason.REGISTRY_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        RejectionReason.PEER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        RejectionReason.NODE_FENCED: grpc.StatusCode.UNAVAILABLE,
        RejectionReason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
        RejectionReason.UNKNOWN_SESSION: grpc.StatusCode.NOT_FOUND,
        RejectionReason.TARGET_ELSEWHERE: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.INBOX_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
        RejectionReason.NODE_OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        RejectionReason.TOOLS_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.TREE_LIMIT: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.TREE_CLOSED: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        RejectionReason.NAMESPACE_DENIED: grpc.StatusCode.PERMISSION_DENIED,
        RejectionReason.QUOTA_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        RejectionReason.APPROVAL_STALE: grpc.StatusCode.FAILED_PRECONDITION,
        RejectionReason.STORE_REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    }
)
"""Each reason travels with exactly this status code; (code, reason) is the wire contract."""

# Node-local errors that are not rejections but can still end a remote call. Both mean that the
# caller reached a node that does not (any longer) hold the session's activation: from the
# caller's side the target's host is unavailable, and a retry is routed to the current one.
_REASON_OF_LOCAL_ERROR: Mapping[type[MeshError], RejectionReason] = MappingProxyType(
    {
        ActivationFenced: RejectionReason.PEER_UNAVAILABLE,
        NotResident: RejectionReason.PEER_UNAVAILABLE,
    }
)

# A status without a mesh ErrorInfo (the gRPC runtime, a proxy, a dropped connection, the
# caller's own deadline) is still typed where its code has one obvious meaning.
_REASON_OF_BARE_CODE: Mapping[grpc.StatusCode, RejectionReason] = MappingProxyType(
    {
        grpc.StatusCode.UNAVAILABLE: RejectionReason.PEER_UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED: RejectionReason.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAUTHENTICATED: RejectionReason.UNAUTHENTICATED,
    }
)

_REASON_BY_NAME: Mapping[str, RejectionReason] = MappingProxyType(
    {reason.value: reason for reason in RejectionReason}
)
_CODE_BY_NUMBER: Mapping[int, grpc.StatusCode] = MappingProxyType(
    {code.value[0]: code for code in grpc.StatusCode}
)


class RemoteError(MeshError):
    """A remote call failed with a status that names no mesh reason.

    Raised by :func:`error_from_rpc` for statuses without a ``dsh.mesh.v1`` ``ErrorInfo`` whose
    code has no obvious mesh meaning (for example ``UNKNOWN`` from a handler crash, ``INTERNAL``
    from a ``MeshError`` that names no reason, ``UNIMPLEMENTED``, ``RESOURCE_EXHAUSTED`` from a
    message-size limit). ``code`` is the gRPC
    status code and ``detail`` the status message; :func:`to_rpc_status` sends both on unchanged,
    so a forwarding node relays the failure as it got it. Whether anything was accepted is
    unknown; a retry with the same idempotency key is safe.
    """

    code: grpc.StatusCode
    detail: str

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


def status_of(reason: RejectionReason) -> grpc.StatusCode:
    """The gRPC status code a rejection for ``reason`` is sent with."""
    return STATUS_OF_REASON[reason]


def wire_reason(error: MeshError) -> RejectionReason | None:
    """The reason ``error`` travels with, or ``None`` when it names none.

    A :class:`Rejected` travels with its own reason; ``ActivationFenced`` and ``NotResident``
    (the session's activation is not, or no longer, on this node) travel as PEER_UNAVAILABLE;
    any other ``MeshError`` (``SessionExists``, ``TurnFailed``...) is a server fault and names
    no reason.
    """
    if isinstance(error, Rejected):
        return error.reason
    for kind, reason in _REASON_OF_LOCAL_ERROR.items():
        if isinstance(error, kind):
            return reason
    return None


def cut_utf8(text: str, limit: int = MAX_DETAIL_BYTES) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, never inside a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


TARGET_KEY = "target_session_id"
"""The ``ErrorInfo`` metadata key (and the ``Rejection`` field) naming the session the refused
request named."""

_TARGET_FIELD: Mapping[str, str] = MappingProxyType(
    {
        mesh_pb2.SendMessageRequest.DESCRIPTOR.full_name: "agent_id",
        mesh_pb2.SubmitPromptRequest.DESCRIPTOR.full_name: "session_id",
        mesh_pb2.InterruptRequest.DESCRIPTOR.full_name: "session_id",
        mesh_pb2.ResolveApprovalRequest.DESCRIPTOR.full_name: "session_id",
        mesh_pb2.ListApprovalsRequest.DESCRIPTOR.full_name: "root_session_id",
        mesh_pb2.GetSessionRequest.DESCRIPTOR.full_name: "session_id",
        mesh_pb2.WatchSessionRequest.DESCRIPTOR.full_name: "session_id",
        mesh_pb2.ListAgentsRequest.DESCRIPTOR.full_name: "root_session_id",
    }
)


def target_of(request: object) -> str:
    """The session a ``dsh.mesh.v1`` request names as its target: ``agent_id`` of a
    ``SendMessageRequest``, ``session_id`` of a control request (``root_session_id`` of
    ``ListAgents``); ``""`` for any other request, or when the field is not a well-formed
    session id (a refusal never echoes arbitrary bytes into its trailer)."""
    descriptor = getattr(request, "DESCRIPTOR", None)
    field = _TARGET_FIELD.get(getattr(descriptor, "full_name", ""))
    value = getattr(request, field, "") if field is not None else ""
    if not isinstance(value, str) or not value:
        return ""
    try:
        return parse_session_id(value)
    except InvalidArgument:
        return ""


def to_rpc_status(error: MeshError, *, target: str = "") -> status_pb2.Status:
    """The ``google.rpc.Status`` that carries ``error`` across the wire. Pure; no I/O.

    With a reason (see :func:`wire_reason`): code ``status_of(reason)``, message
    ``"<REASON>: <detail>"``, details ``[ErrorInfo, Rejection]`` plus ``RetryInfo`` when the
    reason is retryable. ``target`` (the session the refused request named, see
    :func:`target_of`) goes into the ``ErrorInfo`` metadata as :data:`TARGET_KEY` and into
    ``Rejection.target_session_id``, unless the error's own metadata names one already. A
    :class:`RemoteError` keeps its code and message and has no details. Any other ``MeshError``
    becomes ``INTERNAL`` without details: it is a fault, not a refusal, and clients must not
    branch on it. Details are cut to :data:`MAX_DETAIL_BYTES`.
    """
    if isinstance(error, RemoteError):
        return status_pb2.Status(code=error.code.value[0], message=cut_utf8(error.detail))
    reason = wire_reason(error)
    if reason is None:
        message = cut_utf8(f"{type(error).__name__}: {error}")
        return status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message)
    if isinstance(error, Rejected):
        detail = cut_utf8(error.detail)
        metadata = {
            cut_utf8(k, MAX_METADATA_BYTES): cut_utf8(v, MAX_METADATA_BYTES)
            for k, v in error.metadata.items()
        }
    else:
        detail, metadata = cut_utf8(f"{type(error).__name__}: {error}"), {}
    if target:
        metadata.setdefault(TARGET_KEY, target)
    status = status_pb2.Status(
        code=status_of(reason).value[0], message=cut_utf8(f"{reason.value}: {detail}")
    )
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(reason=reason.value, domain=ERROR_DOMAIN, metadata=metadata)
    )
    status.details.add().Pack(
        mesh_pb2.Rejection(
            reason=f"REJECTION_REASON_{reason.value}",
            detail=detail,
            target_session_id=metadata.get(TARGET_KEY, ""),
        )
    )
    if reason in RETRYABLE_REASONS:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(max(RETRY_DELAY, _retry_after(metadata)))
        status.details.add().Pack(retry)
    return status


def _retry_after(metadata: Mapping[str, str]) -> timedelta:
    """The delay a rejection's own ``retry_after_ms`` asks for (zero when it names none)."""
    asked = metadata.get(RETRY_AFTER_KEY, "")
    return (
        timedelta(milliseconds=int(asked)) if asked.isdigit() and len(asked) < 10 else timedelta()
    )


async def abort_with(
    context: grpc.aio.ServicerContext, error: MeshError, *, target: str = ""
) -> NoReturn:
    """End the current RPC with the status :func:`to_rpc_status` builds for ``error`` (and
    ``target``, the session the request named: see :func:`target_of`).

    Call it from a grpc.aio handler; it never returns (gRPC raises to unwind the handler, and
    the exception must be left to propagate). Only ``MeshError`` belongs here: let anything else
    propagate and grpc.aio reports it as ``UNKNOWN``.
    """
    await context.abort_with_status(rpc_status.to_status(to_rpc_status(error, target=target)))
    raise AssertionError("abort_with_status returned")  # pragma: no cover - gRPC always raises


def _rich_status(metadata: Iterable[tuple[str, object]] | None) -> status_pb2.Status | None:
    for key, value in metadata or ():
        if key == DETAILS_METADATA_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:
                return None
    return None


def _mesh_error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo | None:
    """The first ``ErrorInfo`` of domain :data:`ERROR_DOMAIN` among the details; one whose
    bytes do not decode is skipped (the status is then read by its code alone)."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            try:
                detail.Unpack(info)
            except DecodeError:
                continue
            if info.domain == ERROR_DOMAIN:
                return info
    return None


def error_from_rpc(error: grpc.RpcError) -> MeshError:
    """Rebuild the typed mesh error a failed call (sync ``grpc.RpcError`` or
    ``grpc.aio.AioRpcError``) carries. Pure; reads only the error object.

    A ``dsh.mesh.v1`` ``ErrorInfo`` whose reason this client knows gives
    ``Rejected.of(reason, detail, metadata=...)``: the class :func:`rejection_class` names, the
    same reason, ``detail`` = the status message without its ``"<REASON>: "`` prefix, and the
    ``ErrorInfo`` metadata. The details are ignored when their code differs from the call's (a
    proxy rewrote the status). Without a usable ``ErrorInfo`` the code decides: ``UNAVAILABLE``
    -> :class:`PeerUnavailable`, ``DEADLINE_EXCEEDED`` -> :class:`DeadlineExceeded`,
    ``UNAUTHENTICATED`` -> :class:`Unauthenticated`, anything else -> :class:`RemoteError`. Such
    a rebuilt error did not come from a mesh server's decision, so whether the request was
    accepted is unknown: retry it with the same idempotency key to find out.

    Call sites raise the result chained to its cause: ``raise error_from_rpc(e) from e``.
    """
    code_of = getattr(error, "code", None)
    code = code_of() if callable(code_of) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_of = getattr(error, "details", None)
    message = details_of() if callable(details_of) else None
    message = message if isinstance(message, str) else ""
    trailers_of = getattr(error, "trailing_metadata", None)
    status = _rich_status(trailers_of() if callable(trailers_of) else None)
    return _error_of(code, message, status)


def refusal(error: MeshError, *, target: str = "") -> bytes:
    """``error`` as the serialized ``google.rpc.Status`` a carried message's answer holds
    (``MeshPeer.SendMessages``): the status :func:`abort_with` would end a unary call with."""
    return bytes(to_rpc_status(error, target=target).SerializeToString())


def error_from_refusal(refused: bytes) -> MeshError:
    """The typed error a carried message's refusal holds, rebuilt as :func:`error_from_rpc`
    rebuilds a failed call's; a refusal that does not decode is a :class:`RemoteError`
    (``UNKNOWN``)."""
    try:
        status = status_pb2.Status.FromString(refused)
    except DecodeError:
        return RemoteError(grpc.StatusCode.UNKNOWN, "a refusal that is no google.rpc.Status")
    code = _CODE_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    return _error_of(code, status.message, status)


def _error_of(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> MeshError:
    if status is not None and _CODE_BY_NUMBER.get(status.code) is code:
        info = _mesh_error_info(status)
        reason = _REASON_BY_NAME.get(info.reason) if info is not None else None
        if info is not None and reason is not None:
            detail = (status.message or message).removeprefix(f"{reason.value}: ")
            return Rejected.of(reason, detail, metadata=dict(info.metadata))
    bare = _REASON_OF_BARE_CODE.get(code)
    if bare is not None:
        return Rejected.of(bare, message)
    return RemoteError(code, message)


_S = TypeVar("_S")
_Q = TypeVar("_Q")
_R = TypeVar("_R")


def mesh_rpc(
    handler: Callable[[_S, _Q, grpc.aio.ServicerContext[Any, Any]], Awaitable[_R]],
) -> Callable[[_S, _Q, grpc.aio.ServicerContext[Any, Any]], Awaitable[_R]]:
    """Decorate a grpc.aio servicer method so that a ``MeshError`` it raises ends the call with
    the status and details of the one table (:func:`abort_with`), naming the request's target
    (:func:`target_of`); anything else propagates."""

    @functools.wraps(handler)
    async def handle(self: _S, request: _Q, context: grpc.aio.ServicerContext[Any, Any]) -> _R:
        try:
            return await handler(self, request, context)
        except MeshError as error:
            await abort_with(context, error, target=target_of(request))

    return handle
