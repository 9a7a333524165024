"""Spans, links and the durable trace context, over the OpenTelemetry API.

The rest of the package asks this module for spans; it never imports OpenTelemetry. With no
tracer provider installed (see :func:`dsh_mesh.telemetry.configure`) a span runs nothing of
OpenTelemetry: it is one shared handle that records nothing and leaves the context as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Literal

from opentelemetry import baggage, context, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

AttributeValue = str | bool | int | float | Sequence[str]
Kind = Literal["internal", "client", "server", "producer", "consumer"]

_TRACER = trace.get_tracer("dsh_mesh")
_PROPAGATOR = TraceContextTextMapPropagator()
_KINDS = {
    "internal": SpanKind.INTERNAL,
    "client": SpanKind.CLIENT,
    "server": SpanKind.SERVER,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}
SENDER_BAGGAGE = "dsh.sender.traceparent"
"""Baggage key carrying the sender's span across the gRPC hop, so the target node stores the
context of the span that *sent* a message, not of its own server span."""
# The only form a transcript stores (dsh_mesh.core's check, repeated here): W3C Trace Context
# version 00, lowercase hex, neither the trace id nor the span id all zeros.
_STORED_TRACEPARENT = re.compile(r"00-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-[0-9a-f]{2}")


class SpanHandle:
    """The span of a ``with span(...)`` block: add attributes, record an error, read its
    context as a W3C ``traceparent``."""

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def set(self, key: str, value: AttributeValue | None) -> None:
        """Set one attribute (``None`` is skipped)."""
        if value is not None:
            self._span.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, AttributeValue | None]) -> None:
        """Set several attributes (``None`` values are skipped)."""
        for key, value in attributes.items():
            self.set(key, value)

    def fail(self, error: BaseException, *, description: str | None = None) -> None:
        """Mark the span failed by ``error`` (the exception is recorded as an event)."""
        self._span.record_exception(error)
        self._span.set_status(Status(StatusCode.ERROR, description or type(error).__name__))

    @property
    def traceparent(self) -> str:
        """This span's context as a ``traceparent`` ("" when it is not sampled/recorded)."""
        return _traceparent_of(self._span)


def span(
    name: str,
    *,
    kind: Kind = "internal",
    attributes: Mapping[str, AttributeValue | None] | None = None,
    links: Sequence[str] = (),
) -> AbstractContextManager[SpanHandle]:
    """A span, current for the block. ``links`` are ``traceparent`` strings (empty or malformed
    ones are skipped). An exception leaving the block marks the span failed and propagates.

    With no tracer provider installed, the block gets :data:`_UNTRACED`, and nothing of
    OpenTelemetry runs: its no-op tracer would make a non-recording span with the current
    span's context and attach a new context for the block, which changes nothing anyone reads
    and, at several spans a message, cost about a tenth of a node's CPU (ADR 0047)."""
    if _untraced():
        return _UNTRACED
    return _traced(name, kind=kind, attributes=attributes, links=links)


@contextmanager
def _traced(
    name: str,
    *,
    kind: Kind,
    attributes: Mapping[str, AttributeValue | None] | None,
    links: Sequence[str],
) -> Iterator[SpanHandle]:
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    span_links = [Link(c) for c in (_span_context(t) for t in links) if c is not None]
    with _TRACER.start_as_current_span(
        name,
        kind=_KINDS[kind],
        attributes=clean,
        links=span_links,
        record_exception=True,
        set_status_on_exception=True,
    ) as current:
        yield SpanHandle(current)


class _Untraced(SpanHandle, AbstractContextManager[SpanHandle]):
    """The span of a block with no tracer provider installed: records nothing, and its context
    is the current one (a non-recording span's would be the same)."""

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN)

    def __enter__(self) -> SpanHandle:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def set(self, key: str, value: AttributeValue | None) -> None:
        return None

    def set_many(self, attributes: Mapping[str, AttributeValue | None]) -> None:
        return None

    def fail(self, error: BaseException, *, description: str | None = None) -> None:
        return None

    @property
    def traceparent(self) -> str:
        return current_traceparent()


def _untraced() -> bool:
    """Whether no tracer provider is installed in this process. OpenTelemetry's own global is
    read, not its getter: while none is set, the getter looks the environment up at each call
    (a few per message). A provider the environment names was loaded already, by the getter's
    call in ``trace.get_tracer`` when this module was imported; an API without that global
    takes the API's own path."""
    return getattr(trace, "_TRACER_PROVIDER", trace) is None


_UNTRACED = _Untraced()


def current_traceparent() -> str:
    """The current span's ``traceparent``, or "" when there is none (or tracing is off)."""
    return _traceparent_of(trace.get_current_span())


def sender_traceparent() -> str:
    """The sending span's ``traceparent``: carried in baggage when the send crossed nodes,
    else the current span's; "" when there is none.

    Always "" or a version-00 ``traceparent``, the one form a transcript stores: trace data
    must never change whether a message is accepted. A carried value of another W3C version
    that parses (its first four fields as version 00) is re-written as version 00 with the same
    trace id, span id and flags; a carried value that does not parse is ignored."""
    carried = baggage.get_baggage(SENDER_BAGGAGE)
    if isinstance(carried, str):
        sender = _version_00(carried)
        if sender:
            return sender
    return _version_00(current_traceparent())


@contextmanager
def carrying_sender(traceparent: str) -> Iterator[None]:
    """Within the block, calls to other nodes carry ``traceparent`` as the sender's span."""
    if not traceparent:
        yield
        return
    token = context.attach(baggage.set_baggage(SENDER_BAGGAGE, traceparent))
    try:
        yield
    finally:
        context.detach(token)


def _traceparent_of(current: trace.Span) -> str:
    span_context = current.get_span_context()
    if not span_context.is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(current))
    return carrier.get("traceparent", "")


def _version_00(traceparent: str) -> str:
    """``traceparent`` as the version-00 ``traceparent`` a transcript stores, or "" when it is
    not a valid W3C ``traceparent`` of any version."""
    if _is_stored_form(traceparent):
        return traceparent
    span_context = _span_context(traceparent)
    if span_context is None:
        return ""
    rewritten = (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{int(span_context.trace_flags):02x}"
    )
    return rewritten if _is_stored_form(rewritten) else ""


def _is_stored_form(traceparent: str) -> bool:
    match = _STORED_TRACEPARENT.fullmatch(traceparent)
    return match is not None and match["trace"] != "0" * 32 and match["span"] != "0" * 16


def _span_context(traceparent: str) -> trace.SpanContext | None:
    if not traceparent:
        return None
    extracted = _PROPAGATOR.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(extracted).get_span_context()
    return span_context if span_context.is_valid else None
