"""An in-process OTLP/gRPC receiver that collects what real node processes export.

Integration tests and the demo start an :class:`OtlpReceiver` on a free loopback port, hand
:func:`otel_env` of its endpoint to the node processes they launch, then wait on what arrives
(:meth:`OtlpReceiver.wait_for`) and assert on spans and metric points flattened into plain,
frozen dataclasses, so no test touches a ``*_pb2`` message. :func:`render_trace_tree` prints one
trace as an indented tree for failure messages and the demo.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeAlias

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

_LOOPBACK = "127.0.0.1"
_STOP_GRACE = 0.5
_SUMMARY_NAMES = 8
_ATTRIBUTE_PREFIXES = ("dsh.", "gen_ai.", "rpc.method")
_MAX_VALUE_CHARS = 60

AttributeValue: TypeAlias = "str | bool | int | float | list[AttributeValue]"
"""An OTLP attribute value as plain Python: arrays become lists, bytes become lowercase hex."""

Attributes: TypeAlias = dict[str, AttributeValue]


@dataclass(frozen=True, kw_only=True)
class CollectedSpan:
    """One exported span, flattened from OTLP.

    Ids are lowercase hex (``parent_span_id`` is ``""`` for a root); ``kind`` and ``status`` are
    the proto enum names without their prefix (``"SERVER"``, ``"ERROR"``); ``links`` holds
    ``(trace_id, span_id, attributes)`` triples in export order; ``service_name`` is the
    resource's ``service.name`` (``""`` if absent) and ``resource`` all of its attributes.
    Instances hash by their scalar fields only (the dicts are left out of the hash).
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    attributes: Attributes = field(hash=False)
    links: tuple[tuple[str, str, Attributes], ...] = field(hash=False)
    status: str
    status_message: str
    start_unix_nano: int
    end_unix_nano: int
    service_name: str
    resource: Attributes = field(hash=False)

    @property
    def duration_ms(self) -> float:
        """End minus start, in milliseconds."""
        return (self.end_unix_nano - self.start_unix_nano) / 1e6


@dataclass(frozen=True, kw_only=True)
class CollectedPoint:
    """One exported metric data point, flattened from OTLP.

    For a sum or gauge, ``value`` is the point's number (``int`` or ``float`` as exported) and
    ``sum`` is None; for a histogram (explicit or exponential), ``value`` is the point's count
    and ``sum`` its sum (None if the exporter left it out). ``service_name`` is the resource's
    ``service.name`` (``""`` if absent). The SDK exports cumulative values by default, so a
    counter's newest point is its running total, not an increment.
    """

    name: str
    attributes: Attributes = field(hash=False)
    value: int | float
    sum: float | None
    service_name: str
    time_unix_nano: int
    instance: str = ""
    """The resource's ``service.instance.id``: which process (node) exported the point."""


class OtlpReceiver:
    """An OTLP/gRPC collector in this process: the trace, metrics and logs ``Export`` RPCs on
    ``127.0.0.1`` and a free port, keeping everything it receives in memory.

    Lifecycle: :meth:`start` returns once the server listens (then :attr:`endpoint` is valid);
    :meth:`stop` stops it with a short grace period and is idempotent; ``async with
    OtlpReceiver() as receiver:`` does both. A receiver runs once: it cannot be started again
    after it stopped. Log records are accepted and counted (:attr:`log_record_count`) but not
    kept.

    Threading: the RPC handlers run on the event loop that called :meth:`start`; every method
    must be called from that loop (the OTel SDK's blocking ``force_flush``/``shutdown`` belong in
    ``asyncio.to_thread`` so the loop keeps serving). The accessors return copies taken at the
    time of the call.
    """

    def __init__(self) -> None:
        """Prepare a receiver; nothing listens until :meth:`start`."""
        self._server: Any = None
        self._port: int | None = None
        self._stopped = False
        self._spans: list[CollectedSpan] = []
        self._points: list[CollectedPoint] = []
        self._log_records = 0
        self._changed = asyncio.Condition()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind ``127.0.0.1:0``, start serving, and return once the server listens.

        Raises ``RuntimeError`` if the receiver was already started or stopped.
        """
        if self._server is not None or self._stopped:
            raise RuntimeError("OtlpReceiver.start: a receiver starts once")
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self), server
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _MetricsService(self), server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _LogsService(self), server
        )
        port = server.add_insecure_port(f"{_LOOPBACK}:0")
        if not port:
            raise RuntimeError(f"OtlpReceiver.start: could not bind {_LOOPBACK}:0")
        self._server = server
        await server.start()
        self._port = int(port)

    async def stop(self) -> None:
        """Stop serving, letting in-flight exports finish for a short grace period (0.5 s).

        Idempotent; calling it on a receiver that never started just marks it stopped. What
        was collected stays readable.
        """
        self._stopped = True
        server, self._server = self._server, None
        if server is not None:
            await server.stop(_STOP_GRACE)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The port the receiver listens on; ``RuntimeError`` before :meth:`start`."""
        if self._port is None:
            raise RuntimeError("OtlpReceiver was never started: it has no port yet")
        return self._port

    @property
    def endpoint(self) -> str:
        """``"http://127.0.0.1:<port>"``: the value for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (with
        ``insecure``); ``RuntimeError`` before :meth:`start`."""
        return f"http://{_LOOPBACK}:{self.port}"

    # -- what arrived ---------------------------------------------------------------------------

    def spans(self, name: str | None = None) -> list[CollectedSpan]:
        """Every span received so far in arrival order, only those called ``name`` if given."""
        return [s for s in self._spans if name is None or s.name == name]

    def traces(self) -> dict[str, list[CollectedSpan]]:
        """The spans received so far grouped by trace id (in order of each trace's first
        arrival), each trace's spans ordered by start time."""
        grouped: dict[str, list[CollectedSpan]] = {}
        for span in self._spans:
            grouped.setdefault(span.trace_id, []).append(span)
        for spans in grouped.values():
            spans.sort(key=lambda s: s.start_unix_nano)
        return grouped

    def points(self, name: str) -> list[CollectedPoint]:
        """Every data point of metric ``name`` received so far, in arrival order."""
        return [p for p in self._points if p.name == name]

    def latest(self, name: str, **attributes: AttributeValue) -> int | float | None:
        """The current total of metric ``name`` over the series matching ``attributes``.

        A series is one (``service_name``, ``instance``, full attribute set) triple.
        Exporters send cumulative values periodically, so the same series arrives many times:
        for each matching series only its newest point counts (largest ``time_unix_nano``; the
        later arrival on a tie), and the result is the sum of those newest values across all
        matching series, that is across processes and across attribute sets the filter does
        not pin. A point matches when each given attribute equals the point's (pass dotted keys
        as ``**{"dsh.kind": "x"}``); with no filter every series counts. For histograms the
        value summed is the count.
        Returns None when no point matches, so "never exported" differs from 0.
        """
        newest: dict[tuple[str, str, str], CollectedPoint] = {}
        for point in self._points:
            if point.name != name:
                continue
            if any(point.attributes.get(k) != v for k, v in attributes.items()):
                continue
            key = (point.service_name, point.instance, repr(sorted(point.attributes.items())))
            held = newest.get(key)
            if held is None or point.time_unix_nano >= held.time_unix_nano:
                newest[key] = point
        if not newest:
            return None
        return sum(point.value for point in newest.values())

    @property
    def log_record_count(self) -> int:
        """How many log records have been received (their content is not kept)."""
        return self._log_records

    def summary(self) -> str:
        """A one-line account of what arrived: span count and names, metric names, log count."""
        span_names = _first_distinct(s.name for s in self._spans)
        metric_names = _first_distinct(p.name for p in self._points)
        return (
            f"{len(self._spans)} spans in {len({s.trace_id for s in self._spans})} traces "
            f"[{span_names}]; {len(self._points)} metric points [{metric_names}]; "
            f"{self._log_records} log records"
        )

    async def wait_for(
        self,
        predicate: Callable[[OtlpReceiver], bool],
        *,
        within: float = 20.0,
        what: str,
    ) -> None:
        """Return as soon as ``predicate(self)`` holds, checking now and again after every
        ``Export`` call that arrives (no polling).

        Raises ``TimeoutError`` naming ``what`` and summarizing what was received if it does
        not hold within ``within`` seconds. Exceptions from ``predicate`` propagate.
        """
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(lambda: predicate(self))
        except TimeoutError as exc:
            raise TimeoutError(
                f"OTLP receiver: no {what} within {within:g} s; received {self.summary()}"
            ) from exc

    # -- called by the services -----------------------------------------------------------------

    async def _received_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = _service_name(resource)
            for scope_spans in resource_spans.scope_spans:
                self._spans.extend(_span(span, service, resource) for span in scope_spans.spans)
        await self._notify()

    async def _received_metrics(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest
    ) -> None:
        for resource_metrics in request.resource_metrics:
            resource = _attributes(resource_metrics.resource.attributes)
            service = _service_name(resource)
            instance = str(resource.get("service.instance.id", ""))
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    self._points.extend(_points(metric, service, instance))
        await self._notify()

    async def _received_logs(self, request: logs_service_pb2.ExportLogsServiceRequest) -> None:
        self._log_records += sum(
            len(scope_logs.log_records)
            for resource_logs in request.resource_logs
            for scope_logs in resource_logs.scope_logs
        )
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        await self._receiver._received_spans(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: object
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        await self._receiver._received_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(
        self, request: logs_service_pb2.ExportLogsServiceRequest, context: object
    ) -> logs_service_pb2.ExportLogsServiceResponse:
        await self._receiver._received_logs(request)
        return logs_service_pb2.ExportLogsServiceResponse()


# -- conversion from OTLP ------------------------------------------------------------------------


def _value(value: common_pb2.AnyValue) -> AttributeValue | None:
    match value.WhichOneof("value"):
        case "string_value":
            return value.string_value
        case "bool_value":
            return value.bool_value
        case "int_value":
            return value.int_value
        case "double_value":
            return value.double_value
        case "bytes_value":
            return value.bytes_value.hex()
        case "array_value":
            items = (_value(v) for v in value.array_value.values)
            return [v for v in items if v is not None]
        case "kvlist_value":
            # Not produced by the Python SDK; kept readable rather than dropped.
            return [f"{k}={v!r}" for k, v in _attributes(value.kvlist_value.values).items()]
        case _:
            return None


def _attributes(pairs: Iterable[common_pb2.KeyValue]) -> Attributes:
    found: Attributes = {}
    for pair in pairs:
        value = _value(pair.value)
        if value is not None:
            found[pair.key] = value
    return found


def _service_name(resource: Attributes) -> str:
    name = resource.get("service.name", "")
    return name if isinstance(name, str) else str(name)


def _enum_suffix(full: str, prefix: str) -> str:
    return full.removeprefix(prefix)


def _span(span: trace_pb2.Span, service: str, resource: Attributes) -> CollectedSpan:
    return CollectedSpan(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        name=span.name,
        kind=_enum_suffix(trace_pb2.Span.SpanKind.Name(span.kind), "SPAN_KIND_"),
        attributes=_attributes(span.attributes),
        links=tuple(
            (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
            for link in span.links
        ),
        status=_enum_suffix(trace_pb2.Status.StatusCode.Name(span.status.code), "STATUS_CODE_"),
        status_message=span.status.message,
        start_unix_nano=span.start_time_unix_nano,
        end_unix_nano=span.end_time_unix_nano,
        service_name=service,
        resource=dict(resource),
    )


def _number(point: metrics_pb2.NumberDataPoint) -> int | float:
    if point.WhichOneof("value") == "as_int":
        return point.as_int
    return point.as_double


def _points(metric: metrics_pb2.Metric, service: str, instance: str) -> list[CollectedPoint]:
    kind = metric.WhichOneof("data")
    if kind in ("sum", "gauge"):
        numbers = metric.sum.data_points if kind == "sum" else metric.gauge.data_points
        return [
            CollectedPoint(
                name=metric.name,
                attributes=_attributes(p.attributes),
                value=_number(p),
                sum=None,
                service_name=service,
                time_unix_nano=p.time_unix_nano,
                instance=instance,
            )
            for p in numbers
        ]
    if kind in ("histogram", "exponential_histogram"):
        histograms: Iterable[
            metrics_pb2.HistogramDataPoint | metrics_pb2.ExponentialHistogramDataPoint
        ] = (
            metric.histogram.data_points
            if kind == "histogram"
            else metric.exponential_histogram.data_points
        )
        return [
            CollectedPoint(
                name=metric.name,
                attributes=_attributes(p.attributes),
                value=p.count,
                sum=p.sum if p.HasField("sum") else None,
                service_name=service,
                time_unix_nano=p.time_unix_nano,
                instance=instance,
            )
            for p in histograms
        ]
    # Summaries (and empty metrics) carry nothing the tests read.
    return []


def _first_distinct(names: Iterable[str]) -> str:
    seen = list(dict.fromkeys(names))
    shown = ", ".join(seen[:_SUMMARY_NAMES])
    return shown + (f", ... (+{len(seen) - _SUMMARY_NAMES})" if len(seen) > _SUMMARY_NAMES else "")


# -- environment and rendering --------------------------------------------------------------------


def otel_env(endpoint: str, *, service_name: str | None = None) -> dict[str, str]:
    """The ``OTEL_*`` environment that makes a node process export traces and metrics by
    OTLP/gRPC to ``endpoint`` (for example :attr:`OtlpReceiver.endpoint`), promptly: spans
    batched every 100 ms, metrics every 500 ms, every trace sampled, logs not exported.
    ``OTEL_SERVICE_NAME`` is set only when ``service_name`` is given. Returns a new dict to
    merge over the child's environment; pure.
    """
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    if service_name is not None:
        env["OTEL_SERVICE_NAME"] = service_name
    return env


def render_trace_tree(spans: Sequence[CollectedSpan], trace_id: str) -> list[str]:
    """One trace of ``spans`` as indented lines, one per span (plus one per link).

    Children sit two spaces deeper than their parent; siblings and roots are ordered by start
    time. Spans whose parent is not among ``spans`` are shown as roots. Each line reads
    ``name [service.name] 12.3 ms`` followed by the span's ``dsh.*``, ``gen_ai.*`` and
    ``rpc.method*`` attributes as ``key=value`` (long values cut) and ``status=ERROR`` for a
    failed span; each link follows its span as ``-> link to <name>``, naming the linked span
    if it is among ``spans`` (any trace), else its id. Returns ``[]`` for an unknown trace.
    """
    trace_id = trace_id.lower()
    names = {s.span_id: s.name for s in spans}
    members = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_unix_nano)
    present = {s.span_id for s in members}
    children: dict[str, list[CollectedSpan]] = {}
    roots: list[CollectedSpan] = []
    for span in members:
        if span.parent_span_id and span.parent_span_id in present:
            children.setdefault(span.parent_span_id, []).append(span)
        else:
            roots.append(span)
    lines: list[str] = []
    shown: set[str] = set()

    def walk(span: CollectedSpan, depth: int) -> None:
        if span.span_id in shown:  # a malformed export could loop; show each span once
            return
        shown.add(span.span_id)
        indent = "  " * depth
        lines.append(indent + _describe(span))
        for linked_trace, linked_span, _ in span.links:
            target = names.get(linked_span, linked_span)
            where = "" if linked_trace == trace_id else f" (trace {linked_trace})"
            lines.append(f"{indent}  -> link to {target}{where}")
        for child in children.get(span.span_id, []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return lines


def _describe(span: CollectedSpan) -> str:
    parts = [span.name, f"[{span.service_name}]", f"{span.duration_ms:.1f} ms"]
    for key in sorted(span.attributes):
        if key.startswith(_ATTRIBUTE_PREFIXES):
            parts.append(f"{key}={_short(span.attributes[key])}")
    if span.status == "ERROR":
        parts.append("status=ERROR")
    return " ".join(parts)


def _short(value: AttributeValue) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."
