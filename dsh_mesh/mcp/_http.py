"""The HTTP client of a node's connection to a streamable-HTTP MCP server, held to a bound.

The SDK reads a server's plain JSON answer (``application/json``, a server in JSON-response
mode) whole before it parses it: a 50 MB answer would be 50 MB in the node's memory. Here the
body is held to the connection's per-message limit while it is read (the same as a stdio
frame's, :func:`~dsh_mesh.mcp._frames.frame_limit`): past it only its head and its last bytes
are kept, and the SDK is handed the answer a stdio frame that large gets
(:func:`~dsh_mesh.mcp._frames.answer_for_oversized`): to ``tools/call`` a result holding the
start of its first text part and a note of the cut, to anything else a JSON-RPC error. An answer
that names no request of ours fails the read (``AnswerTooLarge``, a ``StreamError`` the SDK
answers the call with as an error). The connection goes on either way. An SSE answer is bounded
per event by the SDK itself (``max_sse_event_size``).

Imported by the connection once the SDK is loaded (it imports ``httpx2``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2

from dsh_mesh.mcp._frames import TAIL_BYTES, Frame, answer_for_oversized


class AnswerTooLarge(httpx2.StreamError):
    """A server's JSON answer passed the per-message limit while it was read."""


def bounded_client(
    headers: Mapping[str, str], *, limit: int, max_output_chars: int
) -> httpx2.AsyncClient:
    """An HTTP client whose JSON answers are held to ``limit`` bytes each (see the module's
    docstring); a cut ``tools/call`` answer shows at most ``max_output_chars``."""
    return httpx2.AsyncClient(
        headers=dict(headers),
        timeout=None,
        transport=_BoundedTransport(httpx2.AsyncHTTPTransport(), limit, max_output_chars),
    )


class _BoundedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int, max_output_chars: int) -> None:
        self._inner = inner
        self._limit = limit
        self._max_output_chars = max_output_chars

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if response.headers.get("content-type", "").lower().startswith("application/json"):
            response.stream = _BoundedStream(
                response.stream, self._limit, _pending(request), self._max_output_chars
            )
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _pending(request: httpx2.Request) -> dict[Any, str]:
    """The JSON-RPC request ``request`` carries, as id -> method (empty for a notification,
    a batch or anything else)."""
    try:
        sent = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return {}
    if isinstance(sent, dict) and "id" in sent and isinstance(sent.get("method"), str):
        return {sent["id"]: sent["method"]}
    return {}


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(
        self, inner: object, limit: int, pending: dict[Any, str], max_output_chars: int
    ) -> None:
        assert isinstance(inner, httpx2.AsyncByteStream)
        self._inner = inner
        self._limit = limit
        self._pending = pending
        self._max_output_chars = max_output_chars

    async def __aiter__(self) -> AsyncIterator[bytes]:
        head, tail, size = bytearray(), b"", 0
        async for chunk in self._inner:
            size += len(chunk)
            room = self._limit - len(head)
            if room > 0:
                head += chunk[:room]
            if size > self._limit:
                tail = (tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        if size <= self._limit:
            yield bytes(head)
            return
        frame = Frame(bytes(head), size, self._limit, tail)
        answer = answer_for_oversized(frame, self._pending, self._max_output_chars)
        if answer is None:
            raise AnswerTooLarge(
                f"the server's answer was {size:,} bytes, over the limit of {self._limit:,}"
                " bytes on one message, and answered no request of ours"
            )
        yield json.dumps(answer).encode()

    async def aclose(self) -> None:
        await self._inner.aclose()
