"""Who is calling, checked by one interceptor (ADR 0015, ADR 0021).

Under mutual TLS the handshake has verified the caller's certificate against the cluster CA, and
the caller is who that certificate names: a node (common name = node id, also a DNS
subjectAltName) or a client (``client:<name>``). The self-named ``x-dsh-node`` header is then
ignored. Only nodes may call ``AgentMesh`` and ``MeshPeer``: any other caller is refused with
``FORGED_SENDER``, since it hosts no agent it could speak for.

In a plaintext cluster (an explicit choice, for local demos) a node authenticates with the
shared cluster token only and names itself in ``x-dsh-node``. The cluster token, when a node has
one, is checked on every call in both modes, in constant time, and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from dsh_mesh.core import (
    InvalidArgument,
    MeshError,
    NodeId,
    Rejected,
    RejectionReason,
    Unauthenticated,
)
from dsh_mesh.transport._status import abort_with
from dsh_mesh.transport._tls import Caller, CallerRole, identity_of_auth_context

TOKEN_HEADER = "x-dsh-cluster-token"
NODE_HEADER = "x-dsh-node"
HOPS_HEADER = "x-dsh-hops"
DECIDED_BY_HEADER = "x-dsh-decided-by"
"""Who decided on an approval request, as the node that handed the decision on authenticated
them: taken from a node only (docs/approvals.md)."""
PERSON_TOKEN_HEADER = "x-dsh-person-token"
"""A person's client token, sent by a gateway (the web view) beside its own credential: the
call then acts with no more than that token's grant, and a decision is recorded as that
token's. A token this cluster does not grant is ``UNAUTHENTICATED`` (ADR 0041)."""
PERSON_HEADER = "x-dsh-person-bin"
"""The name of the person a gateway acts for (UTF-8, printable, at most
:data:`MAX_PERSON_CHARS` characters): a decision is recorded as ``<name> via <credential>``.
The credential vouches for the name; the record keeps both (ADR 0041)."""
MAX_PERSON_CHARS = 128
_GUARDED_PREFIX = "/dsh.mesh."
# Methods only a node may call: a client hosts no agent, so it can speak for no sender.
_NODE_ONLY_PREFIXES = ("/dsh.mesh.v1.AgentMesh/", "/dsh.mesh.peer.v1.MeshPeer/")
# A token must carry at least 128 bits, judged by the alphabet it is drawn from: 32 hex digits,
# 22 base64url characters (``secrets.token_hex(16)``, ``secrets.token_urlsafe(16)``).
MIN_TOKEN_BITS = 128
# Sample values shipped in this repository's files: never a real cluster's secret.
_PLACEHOLDER_MARK = "change-me"
# Nodes send 0 or 1; a longer "count" is no hop count (and int() of a long one is costly).
_MAX_HOPS_DIGITS = 9


@dataclass(frozen=True, kw_only=True)
class ClusterCredential:
    """The shared secret of one cluster. ``repr`` never shows it."""

    token: str

    def __post_init__(self) -> None:
        if _PLACEHOLDER_MARK in self.token.lower():
            raise ValueError(
                "the cluster token is the sample placeholder; make one with"
                " `python3 -c 'import secrets; print(secrets.token_hex(16))'`"
            )
        if token_bits(self.token) < MIN_TOKEN_BITS:
            raise ValueError(
                f"the cluster token is too weak ({token_bits(self.token):.0f} bits, at most);"
                f" it needs {MIN_TOKEN_BITS}: 32 hex digits or 22 base64url characters"
            )

    def __repr__(self) -> str:
        return "ClusterCredential(token=<hidden>)"

    def matches(self, presented: str | None) -> bool:
        """Constant-time comparison with a presented token."""
        return presented is not None and hmac.compare_digest(presented, self.token)

    def metadata(self, node: NodeId, *, hops: int = 0) -> tuple[tuple[str, str], ...]:
        """What a node sends with every call it makes."""
        return ((TOKEN_HEADER, self.token), (NODE_HEADER, node), (HOPS_HEADER, str(hops)))


def token_bits(token: str) -> float:
    """An upper bound of the bits in ``token``: its length times the bits of the smallest usual
    alphabet (digits, hex, one-case letters and digits, base64url, printable) that holds it."""
    if not token:
        return 0.0
    chars = set(token)
    for alphabet in _ALPHABETS:
        if chars <= alphabet:
            return len(token) * math.log2(len(alphabet))
    return len(token) * math.log2(max(95, len(chars)))


_ALPHABETS: tuple[frozenset[str], ...] = tuple(
    frozenset(letters)
    for letters in (
        "0123456789",
        "0123456789abcdef",
        "0123456789ABCDEF",
        "0123456789abcdefghijklmnopqrstuvwxyz",
        "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_",
        "".join(chr(c) for c in range(32, 127)),
    )
)


def call_metadata(
    credential: ClusterCredential | None, node: NodeId, *, hops: int = 0
) -> tuple[tuple[str, str], ...]:
    """The metadata a node sends: its token (when it has one), its id, the hop count."""
    if credential is not None:
        return credential.metadata(node, hops=hops)
    return ((NODE_HEADER, node), (HOPS_HEADER, str(hops)))


def is_tls(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether the call arrived over TLS (a node serves either TLS or plaintext, never both)."""
    security = (context.auth_context() or {}).get("transport_security_type") or ()
    return b"ssl" in security


def caller_identity(context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
    """Who made the call: over TLS the node or client its verified certificate names; in
    plaintext the node id named in ``x-dsh-node`` (unverified, ADR 0015). Raises
    :class:`Unauthenticated` when there is no identity to take."""
    if is_tls(context):
        caller = identity_of_auth_context(context.auth_context())
        if caller is None:
            raise Unauthenticated("the peer certificate names neither a node nor a client")
        return caller
    metadata = dict(context.invocation_metadata() or ())
    node = metadata.get(NODE_HEADER)
    if not isinstance(node, str) or not node:
        raise Unauthenticated("the caller did not name its node")
    return Caller(role=CallerRole.NODE, name=node, verified=False)


def caller_node(context: grpc.aio.ServicerContext[Any, Any]) -> NodeId:
    """The calling node's id (see :func:`caller_identity`). A caller that is not a node (a
    client certificate) is refused with ``FORGED_SENDER``: it hosts no agent."""
    caller = caller_identity(context)
    if caller.role is not CallerRole.NODE:
        raise Rejected.of(
            RejectionReason.FORGED_SENDER,
            f"{caller} is a client, not a node: it hosts no agent it could speak for",
        )
    return NodeId(caller.name)


def decider(
    context: grpc.aio.ServicerContext[Any, Any], credential: ClusterCredential | None
) -> str:
    """Who a decision on an approval request is recorded as made by: a client certificate's
    ``client:<name>``; a client token's ``token:<first 12 hex digits of its SHA-256>``; for
    the cluster token, or a cluster without one, ``operator``. A node handing on a decision
    names the decider it authenticated (:data:`DECIDED_BY_HEADER`), and is believed: it holds
    the cluster's credential. A gateway acting for a person (ADR 0041) narrows this: the
    person's token names the decider in place of the gateway's credential, and the person's
    name leads (``alice via operator``)."""
    metadata = dict(context.invocation_metadata() or ())
    named = metadata.get(DECIDED_BY_HEADER)
    token = metadata.get(TOKEN_HEADER)
    if is_tls(context):
        caller = caller_identity(context)
        if caller.role is CallerRole.NODE:
            if isinstance(named, str) and named:
                return named  # handed on: the first node named the decider
            return _for_person(context, f"node:{caller.name}")
        return _for_person(context, str(caller))
    if credential is None or (isinstance(token, str) and credential.matches(token)):
        from_node = caller_hops(context) > 0 and isinstance(named, str) and bool(named)
        return str(named) if from_node else _for_person(context, "operator")
    if isinstance(token, str):
        return _for_person(context, token_identity(token))
    return _for_person(context, "operator")


def token_identity(token: str) -> str:
    """How a client token is named in a record: ``token:`` and the first 12 hex digits of its
    SHA-256 (the token itself is never written down)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def _for_person(context: grpc.aio.ServicerContext[Any, Any], credential: str) -> str:
    """``credential`` as a decider, narrowed to the person a gateway acts for: the person's
    token names the decider in place of the gateway's credential, and the person's name
    comes first (``alice via token:...``)."""
    metadata = dict(context.invocation_metadata() or ())
    person_token = metadata.get(PERSON_TOKEN_HEADER)
    if isinstance(person_token, str) and person_token:
        credential = token_identity(person_token)
    name = person_name(context)
    return f"{name} via {credential}" if name else credential


def person_name(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The person a gateway names in :data:`PERSON_HEADER` ("" when none). A name that is not
    UTF-8, not printable, or longer than :data:`MAX_PERSON_CHARS` is ``InvalidArgument``."""
    raw = dict(context.invocation_metadata() or ()).get(PERSON_HEADER)
    if raw is None or raw in (b"", ""):
        return ""
    try:
        name = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as bad:
        raise InvalidArgument("the person's name is not UTF-8") from bad
    if len(name) > MAX_PERSON_CHARS or not name.isprintable() or name != name.strip():
        raise InvalidArgument(
            f"the person's name must be 1 to {MAX_PERSON_CHARS} printable characters"
            " without surrounding spaces"
        )
    return name


def caller_hops(context: grpc.aio.ServicerContext[Any, Any]) -> int:
    """How often the call was already handed on between nodes (0 if not said). A value that is
    no count a node sends (anything but 1 to 9 ASCII digits) is ignored, as if not said: never
    a crash, whatever a caller sends."""
    value = dict(context.invocation_metadata() or ()).get(HOPS_HEADER, "0")
    if not isinstance(value, str) or not _is_count(value):
        return 0
    return int(value)


def _is_count(value: str) -> bool:
    return 0 < len(value) <= _MAX_HOPS_DIGITS and value.isascii() and value.isdigit()


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Guards every ``dsh.mesh.*`` method; health and reflection stay open so generic tools
    work.

    - Request bytes that are no message of the method's request type (garbage, a message cut
      short, invalid UTF-8 in a string field) fail with ``INVALID_ARGUMENT`` (reason
      ``INVALID_ARGUMENT``), after the caller checks below: grpc.aio decodes a request before
      any handler runs, and would otherwise answer ``UNKNOWN``.

    - With a ``credential``, a call without the right ``x-dsh-cluster-token`` fails with
      ``UNAUTHENTICATED`` (reason ``UNAUTHENTICATED``); a ``MeshControl`` call may carry a
      client token of ``client_tokens`` instead (ADR 0033: its grant decides what it sees).
      ``credential=None`` (allowed only with TLS) checks no token.
    - Over TLS, a peer certificate that names neither a node nor a client fails with
      ``UNAUTHENTICATED``, and a client calling ``AgentMesh`` or ``MeshPeer`` fails with
      ``PERMISSION_DENIED`` (reason ``FORGED_SENDER``).
    - A ``MeshControl`` call that carries a person's token (:data:`PERSON_TOKEN_HEADER`, from
      a gateway acting for a person) fails with ``UNAUTHENTICATED`` unless ``client_tokens``
      grants it: a cluster without grants has no person to narrow to.
    """

    def __init__(
        self, credential: ClusterCredential | None, *, client_tokens: TokenGrants | None = None
    ) -> None:
        self._credential = credential
        self._client_tokens = client_tokens

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_GUARDED_PREFIX):
            return handler
        node_only = details.method.startswith(_NODE_ONLY_PREFIXES)
        metadata = dict(details.invocation_metadata or ())
        if self._credential is not None:
            token = metadata.get(TOKEN_HEADER)
            if not self._credential.matches(token) and (node_only or not self._grants_token(token)):
                return _refusing(handler, Unauthenticated("missing or wrong cluster credential"))
        person = metadata.get(PERSON_TOKEN_HEADER)
        if not node_only and person is not None and not self._grants_token(person):
            return _refusing(
                handler,
                Unauthenticated("the person's token is not a client token this cluster grants"),
            )
        return _checked(handler, node_only=node_only)

    def _grants_token(self, token: str | None) -> bool:
        return self._client_tokens is not None and self._client_tokens.grants_token(token)


class TokenGrants(Protocol):
    """Client tokens granted namespaces (``Grants``): each authenticates ``MeshControl``
    calls in place of the cluster token, never a node's methods."""

    def grants_token(self, token: str | None) -> bool: ...


def _check_caller(context: grpc.aio.ServicerContext[Any, Any], *, node_only: bool) -> None:
    if not is_tls(context):
        return  # plaintext: the token (above) is all there is; servicers read x-dsh-node
    if node_only:
        caller_node(context)
    else:
        caller_identity(context)


@dataclass(frozen=True)
class _Undecodable:
    """What a guarded deserializer hands on in place of a request it could not decode."""

    error: str


def _decoding(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` made total: bytes it cannot decode become an :class:`_Undecodable`
    (which the handler refuses) instead of an exception grpc.aio would answer ``UNKNOWN``."""
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # DecodeError, and whatever else malformed bytes raise
            return _Undecodable(f"{type(error).__name__}: {error}")

    return decode


async def _admit(
    request: Any, context: grpc.aio.ServicerContext[Any, Any], *, node_only: bool
) -> None:
    """Refuse the call unless its caller may make it and its request bytes decoded."""
    try:
        _check_caller(context, node_only=node_only)
        if isinstance(request, _Undecodable):
            raise InvalidArgument(f"the request is not a well-formed message: {request.error}")
    except MeshError as refused:
        await abort_with(context, refused)


def _checked(handler: Any, *, node_only: bool) -> Any:
    """``handler`` behind a check of the verified caller (the interceptor itself cannot see the
    peer certificate: only the call's context can) and of the request's decoding."""
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await _admit(request, context, node_only=node_only)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        streaming = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await _admit(request, context, node_only=node_only)
            produced = streaming(request, context)
            if inspect.isasyncgen(produced):
                async for item in produced:
                    yield item
            else:
                await produced

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None:
        carrying = handler.stream_stream

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await _admit(None, context, node_only=node_only)
            async for item in carrying(_decoded(requests), context):
                yield item

        return grpc.stream_stream_rpc_method_handler(
            stream_stream,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    return _refusing(handler, Unauthenticated("this kind of method is not served"))


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream's requests; one whose bytes did not decode raises
    :class:`InvalidArgument` from the iteration (the handler answers with it)."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise InvalidArgument(f"a request is not a well-formed message: {request.error}")
        yield request


def _refusing(handler: Any, error: MeshError) -> Any:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await abort_with(context, error)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            refuse,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Either streaming kind: its first argument (a request or the requests) is unread."""
        await abort_with(context, error)
        yield  # pragma: no cover - abort raises

    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            refuse_stream,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_stream_rpc_method_handler(
        refuse_stream,
        request_deserializer=_decoding(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
