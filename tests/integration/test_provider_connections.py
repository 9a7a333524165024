"""The OpenAI-compatible provider and connections its endpoint closes under it, against a tiny
HTTP/1.1 server of this test's own on loopback (llama.cpp's server does it now and then, right
after a streamed response; here it is made to happen every time, so the test never waits for
luck):

- a call that fails before a single byte of its response arrived, on a connection the pool
  reused, is sent again at once on a fresh connection, without spending a retry;
- the same failure on a fresh connection is an ordinary failed attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from dsh_mesh.core import ChatMessage, Role, SessionId
from dsh_mesh.models import (
    ModelRequest,
    OpenAIEndpoint,
    OpenAIProvider,
    ProviderError,
    RetryPolicy,
    complete,
)

REQUEST = ModelRequest(
    session_id=SessionId("s-1"),
    model="m",
    system_prompt="p",
    tools=(),
    messages=(ChatMessage(role=Role.USER, content="hi"),),
)
NO_RETRY = RetryPolicy(max_attempts=1)
"""A failure that spent an attempt fails the call: what is retried at once must not count."""


def sse_body(text: str) -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    events = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return events + b"data: [DONE]\n\n"


@dataclass
class ClosingServer:
    """Answers the first ``answered`` requests of each connection (kept alive), then reads the
    next request on it and closes the connection without a byte of response. Records
    ``(connection, request on it, answered)`` for every request it read."""

    answered: int
    log: list[tuple[int, int, bool]] = field(default_factory=list)
    port: int = 0
    _connections: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection = self._connections
        try:
            for number in range(1, self.answered + 2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                answer = number <= self.answered
                self.log.append((connection, number, answer))
                if not answer:
                    return
                body = sse_body(f"answer {len(self.log)}")
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Connection: keep-alive\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def closing_server(answered: int) -> AsyncIterator[ClosingServer]:
    state = ClosingServer(answered=answered)
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    async with server:
        yield state


def provider_for(server: ClosingServer) -> OpenAIProvider:
    return OpenAIProvider(
        OpenAIEndpoint(base_url=f"http://127.0.0.1:{server.port}/v1", retry=NO_RETRY)
    )


async def test_a_call_dropped_unanswered_on_a_reused_connection_is_resent_at_once() -> None:
    async with closing_server(answered=1) as server:
        provider = provider_for(server)
        try:
            first = await complete(provider, REQUEST)
            second = await complete(provider, REQUEST)
        finally:
            await provider.aclose()
    assert (first.text, second.text) == ("answer 1", "answer 3")
    # The second call went out on the kept-alive connection, which the server closed
    # unanswered; it was sent again on a new connection, and no retry was spent on it.
    assert server.log == [(1, 1, True), (1, 2, False), (2, 1, True)]


async def test_a_call_dropped_unanswered_on_a_fresh_connection_spends_an_attempt() -> None:
    async with closing_server(answered=0) as server:
        provider = provider_for(server)
        try:
            with pytest.raises(ProviderError, match="gave up after 1 attempts") as raised:
                await complete(provider, REQUEST)
        finally:
            await provider.aclose()
    assert raised.value.attempts == 1
    assert server.log == [(1, 1, False)]
