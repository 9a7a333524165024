"""The telemetry module without exporters: what stays true when nothing is configured, and the
pieces that carry trace context (these never set a global provider)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from dsh_mesh import telemetry

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_nothing_configured_means_nothing_exported_and_no_context() -> None:
    handle = telemetry.configure(node_id="n1", environ={})
    assert (handle.tracing, handle.metrics) == (False, False)
    with telemetry.span("dsh.test", attributes={"dsh.session.id": "s-1"}) as span:
        span.set("dsh.seq", 1)
        assert span.traceparent == ""
    assert telemetry.current_traceparent() == ""
    handle.shutdown()
    handle.shutdown()  # idempotent


def test_the_sender_span_rides_in_baggage_only_within_the_block() -> None:
    assert telemetry.sender_traceparent() == ""
    with telemetry.carrying_sender(PARENT):
        assert telemetry.sender_traceparent() == PARENT
    assert telemetry.sender_traceparent() == ""
    with telemetry.carrying_sender(""):
        assert telemetry.sender_traceparent() == ""


def test_malformed_links_are_skipped_not_fatal() -> None:
    with telemetry.span("dsh.step", links=["", "not-a-traceparent", PARENT]) as step:
        assert step.traceparent == ""  # non-recording without a provider


def test_log_records_carry_trace_and_span_ids() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    assert telemetry.TraceContextFilter().filter(record)
    assert (record.__dict__["otel_trace_id"], record.__dict__["otel_span_id"]) == ("-", "-")


def test_an_unknown_exporter_is_refused() -> None:
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        telemetry.configure(node_id="n1", environ={"OTEL_TRACES_EXPORTER": "zipkin-udp"})


async def test_with_tracing_off_a_server_still_takes_the_sender_span_a_caller_carried() -> None:
    """An untraced node next to traced ones: it adds no client interceptor (nothing of its own
    to carry), and its server interceptor only attaches the W3C context a caller sent, so a
    sender's span carried as baggage still reaches the handler (and the stored message)."""
    assert telemetry.client_interceptors() == []
    seen: list[str] = []

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        seen.append(telemetry.sender_traceparent())
        return request

    server = grpc.aio.server(interceptors=telemetry.server_interceptors())
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("t.Echo", {"Call": _raw(echo)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Echo/Call")
            assert await call(b"plain") == b"plain"
            carried = (("baggage", f"{telemetry.SENDER_BAGGAGE}={PARENT}"),)
            assert await call(b"carried", metadata=carried) == b"carried"
    finally:
        await server.stop(None)
    assert seen == ["", PARENT]


def _raw(handler: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(handler)


def test_with_tracing_off_a_span_leaves_the_current_context_as_it_was() -> None:
    """No provider installed: a block's span records nothing, its handle's context is the
    caller's (as a non-recording span's would be), and an error still leaves the block."""
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    with telemetry.carried_context({"traceparent": PARENT}):
        with telemetry.span("dsh.test", attributes={"dsh.seq": 1}) as outer:
            outer.set("dsh.session.id", "s-1")
            outer.fail(RuntimeError("recorded nowhere"))
            assert outer.traceparent == PARENT
            assert telemetry.current_traceparent() == PARENT
            with telemetry.span("dsh.inner", links=[PARENT]) as inner:
                assert inner.traceparent == PARENT
        with pytest.raises(ValueError, match="propagates"), telemetry.span("dsh.failing"):
            raise ValueError("propagates")
        assert telemetry.current_traceparent() == PARENT
    assert telemetry.current_traceparent() == ""
