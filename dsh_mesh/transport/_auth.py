"""Who is calling: the cluster credential every node presents, checked by one interceptor.

Until mutual TLS arrives (the deployment issue) a node authenticates with a shared cluster
token and names itself; the node id it names is the identity the target node checks a sender's
activation against. The token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dsh_mesh.core import NodeId, Unauthenticated
from dsh_mesh.transport._status import abort_with

TOKEN_HEADER = "x-dsh-cluster-token"
NODE_HEADER = "x-dsh-node"
HOPS_HEADER = "x-dsh-hops"
_GUARDED_PREFIX = "/dsh.mesh."
_MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, kw_only=True)
class ClusterCredential:
    """The shared secret of one cluster. ``repr`` never shows it."""

    token: str

    def __post_init__(self) -> None:
        if len(self.token) < _MIN_TOKEN_CHARS:
            raise ValueError(f"the cluster token needs at least {_MIN_TOKEN_CHARS} characters")

    def __repr__(self) -> str:
        return "ClusterCredential(token=<hidden>)"

    def matches(self, presented: str | None) -> bool:
        """Constant-time comparison with a presented token."""
        return presented is not None and hmac.compare_digest(presented, self.token)

    def metadata(self, node: NodeId, *, hops: int = 0) -> tuple[tuple[str, str], ...]:
        """What a node sends with every call it makes."""
        return ((TOKEN_HEADER, self.token), (NODE_HEADER, node), (HOPS_HEADER, str(hops)))


def caller_node(context: grpc.aio.ServicerContext[Any, Any]) -> NodeId:
    """The node id an authenticated caller named (the interceptor already checked the token)."""
    metadata = dict(context.invocation_metadata() or ())
    node = metadata.get(NODE_HEADER)
    if not isinstance(node, str) or not node:
        raise Unauthenticated("the caller did not name its node")
    return NodeId(node)


def caller_hops(context: grpc.aio.ServicerContext[Any, Any]) -> int:
    """How often the call was already handed on between nodes (0 if not said)."""
    value = dict(context.invocation_metadata() or ()).get(HOPS_HEADER, "0")
    return int(value) if isinstance(value, str) and value.isdigit() else 0


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every dsh.mesh.* call that lacks the cluster token with UNAUTHENTICATED and
    reason ``UNAUTHENTICATED``. Health and reflection stay open so generic tools work."""

    def __init__(self, credential: ClusterCredential) -> None:
        self._credential = credential

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_GUARDED_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._credential.matches(metadata.get(TOKEN_HEADER)):
            return handler
        return _refusing(handler)


def _refusing(handler: Any) -> Any:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await abort_with(context, Unauthenticated("missing or wrong cluster credential"))

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await abort_with(context, Unauthenticated("missing or wrong cluster credential"))
        yield  # pragma: no cover - abort raises

    return grpc.unary_stream_rpc_method_handler(
        refuse_stream,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
