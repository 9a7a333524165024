"""Configuring exporters from the standard ``OTEL_*`` environment, once per process.

Nothing is configured unless the environment asks for it: ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER`` (``otlp``, ``console`` or ``none``; ``OTEL_EXPORTER_OTLP_ENDPOINT``
alone implies ``otlp`` for both), ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or
``http/protobuf``), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``
and the SDK's batch and interval settings. The resource always carries the node id
(``dsh.node.id``, also ``service.instance.id``) and the host name.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)

from dsh_mesh.telemetry._logs import TraceContextFilter

_log = logging.getLogger(__name__)


@dataclass
class Telemetry:
    """What :func:`configure` set up; :meth:`shutdown` flushes and stops it (idempotent)."""

    tracing: bool
    metrics: bool
    _tracer_provider: TracerProvider | None = None
    _meter_provider: MeterProvider | None = None

    def shutdown(self) -> None:
        """Flush pending spans and metrics, then stop the exporters."""
        tracer, self._tracer_provider = self._tracer_provider, None
        meter, self._meter_provider = self._meter_provider, None
        if tracer is not None:
            tracer.shutdown()
        if meter is not None:
            meter.shutdown()


def configure(
    *,
    node_id: str,
    default_service_name: str = "dsh-mesh-node",
    environ: Mapping[str, str] | None = None,
) -> Telemetry:
    """Set the global tracer and meter providers as the environment asks; returns the handle.
    Also adds trace and span ids to every log record (``otel_trace_id``, ``otel_span_id``)."""
    env = os.environ if environ is None else environ
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceContextFilter())
    endpoint_set = bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    traces = env.get("OTEL_TRACES_EXPORTER", "otlp" if endpoint_set else "none").strip()
    metric = env.get("OTEL_METRICS_EXPORTER", "otlp" if endpoint_set else "none").strip()
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        traces = metric = "none"
    resource = Resource.create(
        {
            "service.name": env.get("OTEL_SERVICE_NAME", default_service_name),
            "service.instance.id": node_id,
            "dsh.node.id": node_id,
            "host.name": socket.gethostname(),
        }
    )
    handle = Telemetry(tracing=traces != "none", metrics=metric != "none")
    if handle.tracing:
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(traces, env)))
        trace.set_tracer_provider(tracer_provider)
        handle._tracer_provider = tracer_provider
    if handle.metrics:
        reader = PeriodicExportingMetricReader(_metric_exporter(metric, env))
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        metrics.set_meter_provider(meter_provider)
        handle._meter_provider = meter_provider
    _log.info("telemetry: traces=%s metrics=%s", traces, metric)
    return handle


def _http(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http")


def _span_exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: dsh-mesh knows otlp, console, none")
    if _http(env):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        return HttpSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter,
    )

    return OTLPSpanExporter()


def _metric_exporter(name: str, env: Mapping[str, str]) -> MetricExporter:
    if name == "console":
        return ConsoleMetricExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_METRICS_EXPORTER={name!r}: dsh-mesh knows otlp, console, none")
    if _http(env):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpMetricExporter,
        )

        return HttpMetricExporter()
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter,
    )

    return OTLPMetricExporter()
