"""The OpenAI-compatible provider's decisions, over httpx's mock transport (no sockets): what
is retried and for how long, what ends a turn as token exhaustion, what fails it with the
endpoint's message. The same behaviour against a real HTTP server is in
tests/integration/test_openai_provider.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta

import httpx
import pytest

from dsh_mesh.core import ChatMessage, Role, SessionId, TokensExhausted, Usage
from dsh_mesh.models import (
    FinishReason,
    ModelEvent,
    ModelRequest,
    OpenAIEndpoint,
    OpenAIProvider,
    ProviderError,
    RetryPolicy,
    TextDelta,
    complete,
)
from dsh_mesh.models import _openai as openai_module

REQUEST = ModelRequest(
    session_id=SessionId("s-1"),
    model="gpt-test",
    system_prompt="p",
    tools=(),
    messages=(ChatMessage(role=Role.USER, content="hi"),),
)
FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff=timedelta(milliseconds=1),
    max_backoff=timedelta(milliseconds=4),
    budget=timedelta(seconds=5),
)


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + (
        b"data: [DONE]\n\n"
    )


OK_STREAM = sse(
    {"choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}},
)


def ok() -> httpx.Response:
    return httpx.Response(200, content=OK_STREAM, headers={"content-type": "text/event-stream"})


def failure(status: int, message: str, code: str = "", **headers: str) -> httpx.Response:
    body = {"error": {"message": message, "code": code or None, "type": "x"}}
    return httpx.Response(status, json=body, headers=headers)


def provider(
    answers: list[httpx.Response], seen: list[httpx.Request], policy: RetryPolicy = FAST
) -> OpenAIProvider:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    return OpenAIProvider(
        OpenAIEndpoint(base_url="http://model.test/v1", api_key="sk-test", retry=policy),
        transport=httpx.MockTransport(handle),
    )


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_rate_limits_and_server_failures_are_retried_with_the_same_body(status: int) -> None:
    seen: list[httpx.Request] = []
    model = provider([failure(status, "busy"), failure(status, "busy"), ok()], seen)
    response = await complete(model, REQUEST)
    assert response.text == "hello"
    assert response.usage == Usage(input_tokens=9, output_tokens=1)
    assert len(seen) == 3
    assert len({r.content for r in seen}) == 1
    assert seen[0].url == "http://model.test/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer sk-test"


async def test_retries_stop_at_the_attempt_budget_with_the_providers_message() -> None:
    seen: list[httpx.Request] = []
    model = provider([failure(503, "the model is loading")] * 4, seen)
    with pytest.raises(ProviderError, match="the model is loading") as raised:
        await complete(model, REQUEST)
    assert raised.value.status == 503 and raised.value.attempts == 4
    assert len(seen) == 4


async def test_a_retry_after_past_the_time_budget_gives_up_at_once() -> None:
    seen: list[httpx.Request] = []
    slow = RetryPolicy(max_attempts=5, budget=timedelta(seconds=2))
    model = provider([failure(429, "slow down", **{"retry-after": "30"})], seen, slow)
    with pytest.raises(ProviderError, match="slow down") as raised:
        await complete(model, REQUEST)
    assert raised.value.attempts == 1 and len(seen) == 1


@pytest.mark.parametrize(
    ("status", "code"), [(400, "invalid_request_error"), (401, "invalid_api_key"), (404, "")]
)
async def test_a_refusal_no_retry_can_change_fails_at_once(status: int, code: str) -> None:
    seen: list[httpx.Request] = []
    model = provider([failure(status, "you asked for the wrong thing", code)], seen)
    with pytest.raises(ProviderError, match=f"HTTP {status}: you asked for the wrong thing"):
        await complete(model, REQUEST)
    assert len(seen) == 1


async def test_a_prompt_past_the_context_is_token_exhaustion_not_a_retry() -> None:
    seen: list[httpx.Request] = []
    model = provider(
        [failure(400, "maximum context length exceeded", "context_length_exceeded")], seen
    )
    with pytest.raises(TokensExhausted, match="context"):
        await complete(model, REQUEST)
    assert len(seen) == 1


async def test_a_dropped_connection_before_any_answer_is_retried() -> None:
    calls: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        return ok()

    model = OpenAIProvider(
        OpenAIEndpoint(base_url="http://model.test/v1", retry=FAST),
        transport=httpx.MockTransport(handle),
    )
    assert (await complete(model, REQUEST)).text == "hello"
    assert len(calls) == 2


async def test_a_stream_that_breaks_after_text_arrived_is_not_retried() -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield b'data: {"choices":[{"index":0,"delta":{"content":"par"}}]}\n\n'
            raise httpx.ReadError("connection reset")

    seen: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(1)
        return httpx.Response(200, stream=Broken(), headers={"content-type": "text/event-stream"})

    model = OpenAIProvider(
        OpenAIEndpoint(base_url="http://model.test/v1", retry=FAST),
        transport=httpx.MockTransport(handle),
    )
    events: list[ModelEvent] = []

    async def read() -> None:
        async for event in model.stream(REQUEST):
            events.append(event)

    with pytest.raises(ProviderError, match="broke off"):
        await read()
    assert events == [TextDelta(text="par")] and len(seen) == 1


async def test_a_server_that_ignores_stream_is_read_whole() -> None:
    whole = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "t", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    seen: list[httpx.Request] = []
    model = provider([httpx.Response(200, json=whole)], seen)
    response = await complete(model, REQUEST)
    assert [c.name for c in response.tool_calls] == ["t"]
    assert response.finish_reason is FinishReason.TOOL_CALLS


async def test_no_key_sends_no_authorization_header() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return ok()

    model = OpenAIProvider(
        OpenAIEndpoint(base_url="http://ollama.test/v1/"), transport=httpx.MockTransport(handle)
    )
    await complete(model, REQUEST)
    assert "authorization" not in seen[0].headers
    assert seen[0].url == "http://ollama.test/v1/chat/completions"


def test_endpoint_settings_are_validated_and_read_from_the_standard_variables() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIEndpoint(base_url="ftp://x")
    env: Callable[[dict[str, str]], OpenAIEndpoint] = OpenAIEndpoint.from_environment
    assert env({}).base_url == "https://api.openai.com/v1" and env({}).api_key is None
    configured = env({"OPENAI_BASE_URL": "http://127.0.0.1:8000/v1", "OPENAI_API_KEY": "sk-9"})
    assert (configured.base_url, configured.api_key) == ("http://127.0.0.1:8000/v1", "sk-9")
    assert "sk-9" not in repr(configured)


# -- a hostile endpoint's body is bounded -------------------------------------------------------

LIMIT = 1024
"""``_MAX_CHUNK_BYTES`` made small, for a test to pass it cheaply."""


class Parts(httpx.AsyncByteStream):
    """A response body sent in the given reads; ``forever`` keeps sending its last one."""

    def __init__(self, *parts: bytes, forever: bool = False) -> None:
        self.parts, self.forever, self.sent = parts, forever, 0

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for part in self.parts:
            self.sent += len(part)
            yield part
        while self.forever:
            self.sent += len(self.parts[-1])
            yield self.parts[-1]


def streaming(body: Parts, status: int = 200, kind: str = "text/event-stream") -> OpenAIProvider:
    return OpenAIProvider(
        OpenAIEndpoint(base_url="http://model.test/v1", retry=FAST),
        transport=httpx.MockTransport(
            lambda request: httpx.Response(status, stream=body, headers={"content-type": kind})
        ),
    )


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_module, "_MAX_CHUNK_BYTES", LIMIT)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("parts", "what"),
    [
        ((b"data: {", b"x" * 100), "a line"),  # no line break, ever
        ((b"data: {}\n", b"data: " + b"x" * 100 + b"\n"), "an event"),  # no blank line, ever
        ((b"x" * 100,), "a completion"),  # the whole-JSON answer of a server ignoring stream
    ],
)
async def test_a_body_without_end_is_refused_once_past_the_limit_never_held_whole(
    parts: tuple[bytes, ...], what: str
) -> None:
    body = Parts(*parts, forever=True)
    kind = "application/json" if what == "a completion" else "text/event-stream"
    with pytest.raises(ProviderError, match=f"sent {what} larger than"):
        await complete(streaming(body, kind=kind), REQUEST)
    assert body.sent < 3 * LIMIT  # read only a little past the limit


@pytest.mark.usefixtures("small_chunks")
async def test_an_endless_refusal_body_is_cut_and_the_status_still_reported() -> None:
    body = Parts(b'{"error": {"message": "' + b"x" * 100, forever=True)
    with pytest.raises(ProviderError, match="HTTP 400") as raised:
        await complete(streaming(body, status=400, kind="application/json"), REQUEST)
    assert raised.value.status == 400 and body.sent < 3 * LIMIT


async def test_line_breaks_split_across_reads_keep_an_event_whole() -> None:
    first = {"choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": None}]}
    second = {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}
    body = Parts(
        b"data: " + json.dumps(first).encode() + b"\r",
        b"\n\r",
        b"\n" + b"data: " + json.dumps(second).encode()[:10],
        json.dumps(second).encode()[10:] + b"\r\r",
        b"data: [DONE]\r\n\r\n",
    )
    assert (await complete(streaming(body), REQUEST)).text == "hello"
