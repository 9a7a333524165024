"""A provider wrapper that records every request, for prefix-invariance checks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsh_mesh.core import SessionId
from dsh_mesh.models._protocol import ModelEvent, ModelProvider, ModelRequest


@dataclass
class RecordingProvider:
    """Forwards to ``inner`` and keeps each request in call order."""

    inner: ModelProvider
    requests: list[ModelRequest] = field(default_factory=list)

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.requests.append(request)
        return self.inner.stream(request)

    def check(self, spec: str) -> None:
        """The wrapped provider's check of a model spec, if it has one."""
        check = getattr(self.inner, "check", None)
        if callable(check):
            check(spec)

    def requests_of(self, session: SessionId) -> list[ModelRequest]:
        return [r for r in self.requests if r.session_id == session]
