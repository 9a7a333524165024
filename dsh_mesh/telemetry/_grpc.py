"""W3C trace context and baggage across gRPC, as interceptors (OpenTelemetry's own)."""

from __future__ import annotations

from typing import Any

from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import negate, service_prefix

# Health checks and reflection are not the mesh's work: no spans for them.
_NOT_TRACED = negate(service_prefix("grpc."))


def client_interceptors() -> list[Any]:
    """Interceptors for a grpc.aio channel: a CLIENT span per call, context injected."""
    return list(aio_client_interceptors(filter_=_NOT_TRACED))  # type: ignore[no-untyped-call]


def server_interceptors() -> list[Any]:
    """Interceptors for a grpc.aio server: a SERVER span per call, context extracted."""
    return [aio_server_interceptor(filter_=_NOT_TRACED)]  # type: ignore[no-untyped-call]
