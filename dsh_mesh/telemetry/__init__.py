"""Telemetry: the one place that talks to OpenTelemetry (docs/telemetry.md).

Spans (:func:`span`) with stable names, durable trace context for links
(:func:`current_traceparent`, :func:`sender_traceparent`, :func:`carrying_sender`), gRPC
propagation as interceptors, the mesh's metrics, and trace ids on log records. Exporters are
configured from the standard ``OTEL_*`` environment by :func:`configure`; with nothing
configured everything here is a no-op of the OpenTelemetry API.
"""

from dsh_mesh.telemetry._grpc import (
    carried_context,
    client_interceptors,
    context_carrier,
    server_interceptors,
)
from dsh_mesh.telemetry._logs import TraceContextFilter
from dsh_mesh.telemetry._metrics import (
    cold_resumed,
    creation_refused,
    lease_lost,
    message_accepted,
    message_rejected,
    model_call,
    observe_node,
    passivated,
    send_duration,
    settled,
    spawn_refused,
)
from dsh_mesh.telemetry._setup import Telemetry, configure
from dsh_mesh.telemetry._tracing import (
    SENDER_BAGGAGE,
    SpanHandle,
    carrying_sender,
    current_traceparent,
    sender_traceparent,
    span,
)

__all__ = [
    "SENDER_BAGGAGE",
    "SpanHandle",
    "Telemetry",
    "TraceContextFilter",
    "carried_context",
    "carrying_sender",
    "client_interceptors",
    "cold_resumed",
    "configure",
    "context_carrier",
    "creation_refused",
    "current_traceparent",
    "lease_lost",
    "message_accepted",
    "message_rejected",
    "model_call",
    "observe_node",
    "passivated",
    "send_duration",
    "sender_traceparent",
    "server_interceptors",
    "settled",
    "span",
    "spawn_refused",
]
