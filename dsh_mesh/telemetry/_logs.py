"""Trace and span ids on every log record."""

from __future__ import annotations

import logging

from opentelemetry import trace


class TraceContextFilter(logging.Filter):
    """Adds ``otel_trace_id`` and ``otel_span_id`` (hex, or "-" outside any span) to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            record.otel_trace_id = format(span_context.trace_id, "032x")
            record.otel_span_id = format(span_context.span_id, "016x")
        else:
            record.otel_trace_id = record.otel_span_id = "-"
        return True
