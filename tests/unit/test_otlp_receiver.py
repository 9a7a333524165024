"""The in-process OTLP receiver, fed by the real OTel SDK over loopback gRPC.

Providers are built locally (never set globally) so other tests see no telemetry. The SDK's
blocking export calls run in a thread so the receiver, on the test's loop, keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from dsh_mesh.testing import (
    CollectedSpan,
    OtlpReceiver,
    otel_env,
    render_trace_tree,
)

COUNTER = "test.messages"
HISTOGRAM = "test.duration"


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as running:
        yield running


def tracer_provider(endpoint: str, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
    )
    return provider


def meter_provider(endpoint: str, service: str) -> MeterProvider:
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint, insecure=True), export_interval_millis=100
    )
    return MeterProvider(
        resource=Resource.create({"service.name": service}), metric_readers=[reader]
    )


def emit_spans(endpoint: str) -> None:
    """An unrelated ``origin`` root, then ``parent`` (SERVER) with a ``child`` (CLIENT) that
    links to the origin and fails."""
    provider = tracer_provider(endpoint, "svc-a")
    tracer = provider.get_tracer("dsh-test")
    with tracer.start_as_current_span("origin") as origin:
        pass
    child_attributes: Attributes = {
        "dsh.hops": 2,
        "gen_ai.request.model": "scripted",
        "ok": True,
        "ratio": 0.5,
        "tags": ["a", "b"],
        "ignored.in.tree": "x",
    }
    link = Link(origin.get_span_context(), {"dsh.link": "reply"})
    with (
        tracer.start_as_current_span(
            "parent", kind=SpanKind.SERVER, attributes={"rpc.method": "Send"}
        ),
        tracer.start_as_current_span(
            "child", kind=SpanKind.CLIENT, links=[link], attributes=child_attributes
        ) as child,
    ):
        child.set_status(Status(StatusCode.ERROR, "boom"))
    provider.force_flush()
    provider.shutdown()


def emit_metrics(endpoint: str) -> None:
    """Cumulative counters from two services, each series exported several times."""
    a = meter_provider(endpoint, "svc-a")
    b = meter_provider(endpoint, "svc-b")
    counter_a = a.get_meter("dsh-test").create_counter(COUNTER)
    histogram_a = a.get_meter("dsh-test").create_histogram(HISTOGRAM)
    counter_b = b.get_meter("dsh-test").create_counter(COUNTER)
    counter_a.add(1, {"outcome": "accepted"})
    a.force_flush()  # svc-a/accepted exported as 1 ...
    counter_a.add(1, {"outcome": "accepted"})
    counter_a.add(1, {"outcome": "rejected"})
    histogram_a.record(0.25)
    histogram_a.record(0.5)
    counter_b.add(5, {"outcome": "accepted"})
    a.shutdown()  # ... then as 2, cumulative; shutdown exports a final time
    b.shutdown()


async def test_spans_are_flattened_with_parents_links_and_resource(
    receiver: OtlpReceiver,
) -> None:
    async with asyncio.TaskGroup() as group:
        group.create_task(asyncio.to_thread(emit_spans, receiver.endpoint))
        await receiver.wait_for(lambda r: len(r.spans()) >= 3, within=10, what="three spans")

    by_name = {s.name: s for s in receiver.spans()}
    assert set(by_name) == {"origin", "parent", "child"}
    origin, parent, child = by_name["origin"], by_name["parent"], by_name["child"]

    assert parent.parent_span_id == "" and origin.parent_span_id == ""
    assert child.parent_span_id == parent.span_id
    assert child.trace_id == parent.trace_id != origin.trace_id
    for span in (origin, parent, child):
        assert len(span.trace_id) == 32 and len(span.span_id) == 16
        assert span.trace_id == span.trace_id.lower()
        assert span.service_name == "svc-a"
        assert span.resource["service.name"] == "svc-a"
        assert "telemetry.sdk.language" in span.resource
        assert 0 < span.start_unix_nano <= span.end_unix_nano

    assert (origin.kind, parent.kind, child.kind) == ("INTERNAL", "SERVER", "CLIENT")
    assert (parent.status, child.status, child.status_message) == ("UNSET", "ERROR", "boom")
    assert child.attributes == {
        "dsh.hops": 2,
        "gen_ai.request.model": "scripted",
        "ok": True,
        "ratio": 0.5,
        "tags": ["a", "b"],
        "ignored.in.tree": "x",
    }
    assert child.links == ((origin.trace_id, origin.span_id, {"dsh.link": "reply"}),)
    assert parent.links == ()

    traces = receiver.traces()
    assert set(traces) == {origin.trace_id, parent.trace_id}
    assert [s.name for s in traces[parent.trace_id]] == ["parent", "child"]
    assert receiver.spans("child") == [child]


async def test_render_trace_tree_nests_children_and_names_links(
    receiver: OtlpReceiver,
) -> None:
    async with asyncio.TaskGroup() as group:
        group.create_task(asyncio.to_thread(emit_spans, receiver.endpoint))
        await receiver.wait_for(lambda r: len(r.spans()) >= 3, within=10, what="three spans")
    spans = receiver.spans()
    (parent,) = receiver.spans("parent")
    (origin,) = receiver.spans("origin")

    lines = render_trace_tree(spans, parent.trace_id.upper())

    assert len(lines) == 3, lines
    assert lines[0].startswith("parent [svc-a] ") and lines[0].endswith(" ms rpc.method=Send")
    assert lines[1].startswith("  child [svc-a] ")
    assert "dsh.hops=2" in lines[1] and "gen_ai.request.model=scripted" in lines[1]
    assert "status=ERROR" in lines[1]
    assert "ignored.in.tree" not in lines[1] and "ratio" not in lines[1]
    assert lines[2] == f"    -> link to origin (trace {origin.trace_id})"

    # Without its parent, the child is a root; without the origin, the link shows its id.
    orphan = render_trace_tree([s for s in spans if s.name == "child"], parent.trace_id)
    assert orphan[0].startswith("child [svc-a] ")
    assert orphan[1] == f"  -> link to {origin.span_id} (trace {origin.trace_id})"
    assert render_trace_tree(spans, "0" * 32) == []


async def test_metric_points_and_latest_take_the_newest_point_per_series(
    receiver: OtlpReceiver,
) -> None:
    def exported(r: OtlpReceiver) -> bool:
        services = {p.service_name for p in r.points(COUNTER)}
        return services == {"svc-a", "svc-b"} and r.latest(COUNTER, outcome="rejected") == 1

    async with asyncio.TaskGroup() as group:
        group.create_task(asyncio.to_thread(emit_metrics, receiver.endpoint))
        await receiver.wait_for(exported, within=10, what="counters from svc-a and svc-b")
    # The shutdowns' final exports have all arrived once the thread returned.

    accepted_a = [
        p.value
        for p in receiver.points(COUNTER)
        if p.service_name == "svc-a" and p.attributes == {"outcome": "accepted"}
    ]
    assert accepted_a[0] == 1 and accepted_a[-1] == 2  # cumulative, exported more than once
    assert all(isinstance(v, int) for v in accepted_a)
    assert all(p.sum is None for p in receiver.points(COUNTER))

    # Newest per (service, attributes), then summed: svc-a 2 + svc-b 5, never 1 + 2 + ... .
    assert receiver.latest(COUNTER, outcome="accepted") == 7
    assert receiver.latest(COUNTER, outcome="rejected") == 1
    assert receiver.latest(COUNTER) == 8
    assert receiver.latest(COUNTER, outcome="unknown") is None
    assert receiver.latest("no.such.metric") is None

    histogram = receiver.points(HISTOGRAM)[-1]
    assert (histogram.value, histogram.sum, histogram.service_name) == (2, 0.75, "svc-a")
    assert histogram.attributes == {}
    assert receiver.latest(HISTOGRAM) == 2


async def test_wait_for_times_out_naming_what_and_what_arrived(receiver: OtlpReceiver) -> None:
    with pytest.raises(TimeoutError, match=r"no the impossible within 0.05 s; received 0 spans"):
        await receiver.wait_for(lambda r: False, within=0.05, what="the impossible")


async def test_wait_for_returns_at_once_when_the_predicate_already_holds(
    receiver: OtlpReceiver,
) -> None:
    await receiver.wait_for(lambda r: r.spans() == [], within=0.05, what="nothing")


async def test_lifecycle_is_start_once_and_stop_idempotent() -> None:
    receiver = OtlpReceiver()
    with pytest.raises(RuntimeError, match="never started"):
        _ = receiver.endpoint
    await receiver.start()
    assert receiver.endpoint == f"http://127.0.0.1:{receiver.port}"
    assert receiver.port > 0
    with pytest.raises(RuntimeError, match="starts once"):
        await receiver.start()
    await receiver.stop()
    await receiver.stop()
    with pytest.raises(RuntimeError, match="starts once"):
        await receiver.start()


def test_otel_env_points_a_process_at_the_receiver() -> None:
    env = otel_env("http://127.0.0.1:4317", service_name="node-a")
    assert env == {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_SERVICE_NAME": "node-a",
    }
    assert "OTEL_SERVICE_NAME" not in otel_env("http://127.0.0.1:4317")


def test_collected_spans_are_frozen_and_hash_by_identity() -> None:
    span = CollectedSpan(
        trace_id="ab" * 16,
        span_id="cd" * 8,
        parent_span_id="",
        name="s",
        kind="INTERNAL",
        attributes={"dsh.x": 1},
        links=(),
        status="UNSET",
        status_message="",
        start_unix_nano=1_000_000,
        end_unix_nano=3_500_000,
        service_name="svc",
        resource={"service.name": "svc"},
    )
    assert span.duration_ms == 2.5
    assert len({span, span}) == 1
    with pytest.raises(AttributeError):
        span.name = "other"  # type: ignore[misc]


async def test_log_records_are_accepted_and_counted(receiver: OtlpReceiver) -> None:
    request = logs_service_pb2.ExportLogsServiceRequest(
        resource_logs=[
            logs_pb2.ResourceLogs(
                scope_logs=[logs_pb2.ScopeLogs(log_records=[logs_pb2.LogRecord()] * 3)]
            )
        ]
    )
    async with grpc.aio.insecure_channel(receiver.endpoint.removeprefix("http://")) as channel:
        stub = logs_service_pb2_grpc.LogsServiceStub(channel)  # type: ignore[no-untyped-call]
        await stub.Export(request, timeout=5)
    await receiver.wait_for(lambda r: r.log_record_count == 3, within=5, what="three logs")
    assert "3 log records" in receiver.summary()
