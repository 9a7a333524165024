"""W3C trace context and baggage across gRPC, as interceptors.

With tracing on (:func:`~dsh_mesh.telemetry.configure` installed an SDK tracer provider) these
are OpenTelemetry's own: a span per call, context injected and extracted. With tracing off they
cost next to nothing: a client adds none (this node records no span whose context could travel),
and a server only attaches the context a caller sent, when it sent one, so that a sender's span
carried as baggage from a traced node is still stored with its message here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context, propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import negate, service_prefix
from opentelemetry.sdk.trace import TracerProvider

# Health checks and reflection are not the mesh's work: no spans for them.
_NOT_TRACED = negate(service_prefix("grpc."))
_W3C_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})


def tracing() -> bool:
    """Whether spans are recorded in this process (an SDK tracer provider is installed)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def client_interceptors() -> list[Any]:
    """Interceptors for a grpc.aio channel: with tracing on, a CLIENT span per call and the
    context injected; none with tracing off."""
    if not tracing():
        return []
    return list(aio_client_interceptors(filter_=_NOT_TRACED))  # type: ignore[no-untyped-call]


def server_interceptors() -> list[Any]:
    """Interceptors for a grpc.aio server: with tracing on, a SERVER span per call and the
    context extracted; with tracing off, only the caller's context, when it sent one."""
    if not tracing():
        return [_CallerContext()]
    return [aio_server_interceptor(filter_=_NOT_TRACED)]  # type: ignore[no-untyped-call]


class _CallerContext(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Attach the W3C context (trace and baggage) a caller sent to its unary call's handler."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        carrier = {
            key: value
            for key, value in handler_call_details.invocation_metadata or ()
            if key in _W3C_HEADERS and isinstance(value, str)
        }
        if handler is None or handler.unary_unary is None or not carrier:
            return handler
        inner = handler.unary_unary
        extracted = propagate.extract(carrier)

        async def unary(request: Any, servicer_context: Any) -> Any:
            token = context.attach(extracted)
            try:
                return await inner(request, servicer_context)
            finally:
                context.detach(token)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def context_carrier() -> dict[str, str]:
    """The W3C context (traceparent, tracestate, baggage) a call made now would carry as
    metadata, for a message that travels inside a stream's frame; empty without one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {key: value for key, value in carrier.items() if key in _W3C_HEADERS}


@contextmanager
def carried_context(carrier: Mapping[str, str]) -> Iterator[None]:
    """Within the block, the context :func:`context_carrier` took on the calling node is the
    current one (only its W3C keys; none: the block runs in the current context)."""
    headers = {key: value for key, value in carrier.items() if key in _W3C_HEADERS}
    if not headers:
        yield
        return
    token = context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        context.detach(token)
