"""The local chat-completions server against a real HTTP client (httpx) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import pytest

from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    Failure,
    RecordedRequest,
    ScriptedToolCall,
    Stall,
)

_DEADLINE = 2.0


@pytest.fixture
async def server() -> AsyncIterator[ChatCompletionsServer]:
    async with ChatCompletionsServer() as chat:
        yield chat


@pytest.fixture
async def client(server: ChatCompletionsServer) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(server) as http:
        yield http


def _client(server: ChatCompletionsServer, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, timeout=_DEADLINE, headers=headers)


def _body(
    *contents: str,
    stream: bool = True,
    include_usage: bool = False,
    model: str = "gpt-test",
    tools: list[Any] | None = None,
) -> bytes:
    """A compact request body in the field order the project's provider uses."""
    body: dict[str, Any] = {"model": model, "stream": stream}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = tools
    body["messages"] = [{"role": "user", "content": content} for content in contents]
    return json.dumps(body, separators=(",", ":")).encode()


async def _post(client: httpx.AsyncClient, body: bytes) -> httpx.Response:
    return await client.post(
        "chat/completions", content=body, headers={"Content-Type": "application/json"}
    )


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, checking its framing: ``data: ...`` events, then
    ``[DONE]``."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["transfer-encoding"] == "chunked"
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: ")
        events.append(json.loads(block.removeprefix("data: ")))
    return events


def _lines(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The body's lines as an async generator (so it can be closed when left early)."""
    lines = response.aiter_lines()
    assert isinstance(lines, AsyncGenerator)
    return lines


async def _read_to_end(lines: AsyncIterator[str]) -> None:
    async for _ in lines:
        pass


def _deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event["choices"][0]["delta"] for event in events if event["choices"]]


def _reassemble_calls(events: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for delta in _deltas(events):
        for piece in delta.get("tool_calls") or []:
            index = piece["index"]
            if index not in calls:
                assert set(piece) == {"index", "id", "type", "function"}
                assert piece["function"]["arguments"] == ""
                calls[index] = {"id": piece["id"], "name": piece["function"]["name"], "args": ""}
            else:
                # Continuation pieces carry the arguments only, as OpenAI sends them.
                assert set(piece) == {"index", "function"}
                assert set(piece["function"]) == {"arguments"}
                calls[index]["args"] += piece["function"]["arguments"]
    return calls


async def test_streamed_text_reassembles_from_chunks(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    text = "Hello, streaming world! Ünïcode is fine."
    server.enqueue(Completion(text=text, pieces=4))
    events = _events(await _post(client, _body("hi")))

    assert {event["object"] for event in events} == {"chat.completion.chunk"}
    assert len({event["id"] for event in events}) == 1
    assert {event["model"] for event in events} == {"gpt-test"}
    assert all(isinstance(event["created"], int) for event in events)
    assert all("usage" not in event for event in events)
    deltas = _deltas(events)
    assert deltas[0]["role"] == "assistant"
    assert [event["choices"][0]["finish_reason"] for event in events[:-1]] == [None] * (
        len(events) - 1
    )
    assert events[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    contents = [delta["content"] for delta in deltas[1:] if delta.get("content")]
    assert len(contents) == 4
    assert "".join(delta.get("content") or "" for delta in deltas) == text


@pytest.mark.parametrize("interleave", [False, True])
async def test_parallel_tool_calls_reassemble_from_pieces(
    server: ChatCompletionsServer, client: httpx.AsyncClient, interleave: bool
) -> None:
    calls = (
        ScriptedToolCall(call_id="call_a", name="read", arguments='{"path": "/etc/hosts"}'),
        ScriptedToolCall(call_id="call_b", name="send", arguments='{"to": "x", "text": "y"}'),
    )
    server.enqueue(Completion(tool_calls=calls, interleave=interleave))
    events = _events(await _post(client, _body("do two things")))

    first = _deltas(events)[0]
    assert first["role"] == "assistant"
    assert first["content"] is None
    assert first["tool_calls"][0]["id"] == "call_a"  # the role rides on the first call's header
    assert _reassemble_calls(events) == {
        0: {"id": "call_a", "name": "read", "args": calls[0].arguments},
        1: {"id": "call_b", "name": "send", "args": calls[1].arguments},
    }
    order = [piece["index"] for d in _deltas(events) for piece in d.get("tool_calls") or []]
    assert order == ([0, 1, 0, 1, 0, 1, 0, 1] if interleave else [0, 0, 0, 0, 1, 1, 1, 1])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_usage_is_streamed_only_when_asked_for(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Completion(text="a" * 40, completion_tokens=None))
    body = _body("count me", include_usage=True)
    events = _events(await _post(client, body))

    *chunks, last = events
    assert all("usage" in event and event["usage"] is None for event in chunks)
    assert last["choices"] == []
    prompt_tokens = math.ceil(len(body) / 4)
    assert last["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 10,
        "total_tokens": prompt_tokens + 10,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    server.enqueue(Completion(text="x", usage_form="none"))
    events = _events(await _post(client, body))
    assert all(event["choices"] for event in events)


async def test_cached_tokens_follow_the_longest_shared_prefix(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    system = "You are a careful agent. " * 40
    first = _body(system, "first question", stream=False)
    second = _body(system, "first question", "and a follow-up", stream=False)
    other = _body("something else entirely", stream=False, model="other")

    usages = [(await _post(client, body)).json()["usage"] for body in (first, second, other)]
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for usage in usages]

    assert cached[0] == 0
    shared = len(first) - len(b'"}]}')  # the bodies part where the first message list ends
    assert first[:shared] == second[:shared]
    assert cached[1] == shared // 4 // 16 * 16
    assert 0 < cached[1] <= usages[1]["prompt_tokens"] == math.ceil(len(second) / 4)
    assert cached[2] == 0  # shares only '{"model":"' (less than one 16-token block)


async def test_deepseek_and_vllm_usage_forms(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    body = _body("x" * 400, include_usage=True)
    server.enqueue(
        Completion(text="warm", usage_form="deepseek"),
        Completion(text="hot", usage_form="deepseek", completion_tokens=7),
        Completion(text="v", usage_form="vllm"),
    )
    cold = _events(await _post(client, body))[-1]["usage"]
    warm = _events(await _post(client, body))[-1]["usage"]
    vllm = _events(await _post(client, body))[-1]["usage"]

    assert set(cold) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_cache_hit_tokens",
        "prompt_cache_miss_tokens",
    }
    assert cold["prompt_cache_hit_tokens"] == 0
    assert cold["prompt_cache_miss_tokens"] == cold["prompt_tokens"]
    assert warm["completion_tokens"] == 7
    hit = warm["prompt_cache_hit_tokens"]
    assert hit == len(body) // 4 // 16 * 16 > 0
    assert hit + warm["prompt_cache_miss_tokens"] == warm["prompt_tokens"]
    assert vllm["prompt_tokens_details"] is None


async def test_a_whole_completion_when_not_streamed(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    call = ScriptedToolCall(call_id="call_1", name="read", arguments='{"path":"a"}')
    server.enqueue(
        Completion(text="thinking aloud", tool_calls=(call,)),
        Completion(tool_calls=(call,)),
        Completion(text="cut off", finish_reason="length", usage_form="none"),
    )
    both, only_call, cut = [(await _post(client, _body("q", stream=False))) for _ in range(3)]

    assert both.headers["content-type"] == "application/json"
    answer = both.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == "gpt-test"
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "thinking aloud"
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read", "arguments": '{"path":"a"}'},
        }
    ]
    assert answer["usage"]["completion_tokens"] == (len("thinking aloud") + 12) // 4
    assert only_call.json()["choices"][0]["message"]["content"] is None
    cut_answer = cut.json()
    assert cut_answer["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in cut_answer["choices"][0]["message"]
    assert "usage" not in cut_answer


async def test_rate_limit_with_retry_after(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(
        Failure(status=429, code="rate_limit_exceeded", retry_after=2),
        Failure(status=429, message="slow down", retry_after=0.25),
    )
    first = await _post(client, _body("hi"))
    second = await _post(client, _body("hi"))

    assert first.status_code == 429
    assert first.headers["retry-after"] == "2"
    error = first.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests"
    assert error["param"] is None
    assert second.headers["retry-after"] == "0.25"
    assert second.json()["error"]["message"] == "slow down"


async def test_server_errors_and_a_failing_responder_keep_the_server_serving() -> None:
    def responder(request: RecordedRequest) -> Completion:
        if "explode" in str(request.messages):
            raise ValueError("the responder blew up")
        return Completion(text="fine")

    async with ChatCompletionsServer(responder) as server, _client(server) as client:
        server.enqueue(Failure(status=500), Failure(status=503, code="overloaded"))
        crashed = await _post(client, _body("a"))
        overloaded = await _post(client, _body("b"))
        raised = await _post(client, _body("explode"))
        fine = await _post(client, _body("c", stream=False))

        assert crashed.status_code == 500
        assert crashed.json()["error"]["type"] == "server_error"
        assert "retry-after" not in crashed.headers
        assert overloaded.status_code == 503
        assert overloaded.json()["error"]["code"] == "overloaded"
        assert raised.status_code == 500
        assert raised.json()["error"]["message"] == "the responder blew up"
        assert fine.json()["choices"][0]["message"]["content"] == "fine"
        assert server.connections == 1


async def test_an_async_responder_sees_the_request() -> None:
    async def responder(request: RecordedRequest) -> Completion:
        await asyncio.sleep(0)
        return Completion(text=f"{request.model} got {len(request.messages)} messages")

    async with ChatCompletionsServer(responder) as server, _client(server) as client:
        answer = (await _post(client, _body("a", "b", stream=False, model="m1"))).json()
        assert answer["choices"][0]["message"]["content"] == "m1 got 2 messages"


async def test_context_length_is_refused_before_any_reply() -> None:
    async with ChatCompletionsServer(max_context_tokens=30) as server, _client(server) as client:
        server.enqueue(Completion(text="never"))
        big = _body("x" * 200)
        refused = await _post(client, big)

        assert refused.status_code == 400
        prompt_tokens = math.ceil(len(big) / 4)
        assert refused.json()["error"] == {
            "message": (
                "This model's maximum context length is 30 tokens. However, your messages"
                f" resulted in {prompt_tokens} tokens. Please reduce the length of the messages."
            ),
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
        assert server.queued == 1
        assert server.requests[0].body == big  # recorded although refused
        assert _events(await _post(client, _body("hi")))  # a short prompt still passes


async def test_a_wrong_or_missing_api_key_is_refused() -> None:
    async with ChatCompletionsServer(api_key="sk-right") as server:
        async with _client(server) as anonymous, _client(server, Authorization="Bearer no") as bad:
            for client in (anonymous, bad):
                refused = await _post(client, _body("hi"))
                assert refused.status_code == 401
                assert refused.json()["error"]["code"] == "invalid_api_key"
        async with _client(server, Authorization="Bearer sk-right") as good:
            assert (await _post(good, _body("hi"))).status_code == 200
            assert (await good.get("models")).status_code == 200
        assert len(server.requests) == 4  # refused ones too


async def test_several_requests_share_one_keep_alive_connection(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Completion(text="one"), Failure(status=429), Completion(text="three"))
    statuses = [(await _post(client, _body(str(n), stream=n != 2))).status_code for n in range(4)]

    assert statuses == [200, 429, 200, 200]
    assert server.connections == 1
    assert [request.connection for request in server.requests] == [1, 1, 1, 1]
    assert server.open_streams == 0
    assert server.disconnects == 0


async def test_an_abandoned_stall_is_counted_as_a_disconnect(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Stall(text="hmm"))
    async with client.stream("POST", "chat/completions", content=_body("hi")) as response:
        assert response.status_code == 200
        async with contextlib.aclosing(_lines(response)) as lines:
            async for line in lines:
                if line.startswith("data: ") and '"content":"hmm"' in line:
                    break
        assert server.open_streams == 1
        assert server.disconnects == 0
    async with asyncio.timeout(_DEADLINE):
        await server.wait_disconnect()
    assert server.disconnects == 1
    assert server.open_streams == 0
    # The client opens a new connection for the next request; the server serves it.
    assert (await _post(client, _body("again"))).status_code == 200
    assert server.connections == 2


async def test_shutdown_cuts_a_stalled_stream_and_is_idempotent() -> None:
    server = ChatCompletionsServer()
    try:
        await server.start()
        server.enqueue(Stall())
        async with (
            _client(server) as client,
            client.stream("POST", "chat/completions", content=_body("hi")) as response,
            contextlib.aclosing(_lines(response)) as lines,
        ):
            assert (await anext(lines)).startswith("data: ")
            await server.shutdown()
            with pytest.raises(httpx.RemoteProtocolError):
                await _read_to_end(lines)
        assert server.open_streams == 0
        assert server.disconnects == 0  # the server hung up, not the client
        await server.shutdown()
    finally:
        await server.shutdown()


async def test_bodies_are_recorded_byte_exact(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    odd = '{ "model" : "m",\n "messages": [{"role":"user","content":"h\\u00e9 ✓"}] }'.encode()
    server.enqueue(Failure(status=500))

    async def chunked() -> AsyncIterator[bytes]:
        for piece in (b'{"model":"m2",', b'"messages":[]', b"}"):
            yield piece

    await _post(client, odd)
    await client.post("chat/completions", content=chunked())
    await client.post("chat/completions", content=b"not json")

    first, second, third = server.requests
    assert first.body == odd
    assert first.json["messages"][0]["content"] == "hé ✓"
    assert first.headers["content-type"] == "application/json"
    assert first.path == "/v1/chat/completions"
    assert second.headers["transfer-encoding"] == "chunked"
    assert second.body == b'{"model":"m2","messages":[]}'
    assert second.model == "m2"
    assert third.body == b"not json"
    assert third.json is None


async def test_refusals_of_malformed_requests(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    not_json = await client.post("chat/completions", content=b"{")
    no_messages = await client.post("chat/completions", json={"model": "m"})
    no_model = await client.post("chat/completions", json={"messages": []})

    assert [r.status_code for r in (not_json, no_messages, no_model)] == [400, 400, 400]
    assert no_messages.json()["error"]["code"] == "missing_required_parameter"
    assert no_model.json()["error"]["type"] == "invalid_request_error"
    assert server.queued == 0
    assert server.connections == 1


async def test_models_other_paths_and_the_path_without_v1(server: ChatCompletionsServer) -> None:
    root = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=root, timeout=_DEADLINE) as client:
        before = (await client.get("/v1/models")).json()
        await client.post("/chat/completions", content=_body("hi", model="seen-model"))
        after = (await client.get("/models")).json()
        missing = await client.post("/v1/embeddings", json={})

    assert before == {
        "object": "list",
        "data": [{"id": "test-model", "object": "model", "created": 0, "owned_by": "dsh-mesh"}],
    }
    assert [model["id"] for model in after["data"]] == ["seen-model"]
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"
    assert [request.path for request in server.requests] == [
        "/v1/models",
        "/chat/completions",
        "/models",
        "/v1/embeddings",
    ]


async def test_a_client_leaving_mid_stream_is_counted() -> None:
    gate = asyncio.Event()

    async def responder(request: RecordedRequest) -> Completion:
        await gate.wait()
        return Completion(text="a long answer " * 10, pieces=8)

    async with ChatCompletionsServer(responder) as server:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            body = _body("hi")
            head = f"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            async with asyncio.timeout(_DEADLINE):
                await server.wait_requests()
        finally:
            writer.close()
            await writer.wait_closed()
        gate.set()
        async with asyncio.timeout(_DEADLINE):
            await server.wait_disconnect()
        assert server.open_streams == 0


async def test_the_wire_format_of_a_stream(server: ChatCompletionsServer) -> None:
    """One SSE event per HTTP chunk, a keep-alive connection, a chunked request body."""
    server.enqueue(Completion(text="hi", pieces=1), Completion(text="again", pieces=1))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        body = _body("x")
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n"
        )
        async with asyncio.timeout(_DEADLINE):
            head = await reader.readuntil(b"\r\n\r\n")
            chunks = []
            while (size := int(await reader.readuntil(b"\r\n"), 16)) > 0:
                chunks.append(await reader.readexactly(size))
                assert await reader.readexactly(2) == b"\r\n"
            assert await reader.readexactly(2) == b"\r\n"
        lines = head.decode().split("\r\n")
        assert lines[0] == "HTTP/1.1 200 OK"
        assert "Transfer-Encoding: chunked" in lines
        assert "Content-Type: text/event-stream; charset=utf-8" in lines
        assert all(chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") for chunk in chunks)
        assert [json.loads(c[6:])["choices"][0]["delta"] for c in chunks[:-1]] == [
            {"role": "assistant", "content": "", "refusal": None},
            {"content": "hi"},
            {},
        ]
        assert chunks[-1] == b"data: [DONE]\n\n"
        assert server.requests[0].body == body

        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(_DEADLINE):
            rest = await reader.read()  # the server closes after this one, as asked
        assert b"\r\nConnection: close\r\n" in rest
        assert b'"content":"again"' in rest
        assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert server.connections == 1
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_stall_without_streaming_sends_nothing_until_the_client_leaves(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Stall())
    waiting = asyncio.create_task(_post(client, _body("hi", stream=False)))
    async with asyncio.timeout(_DEADLINE):
        await server.wait_requests()
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    async with asyncio.timeout(_DEADLINE):
        await server.wait_disconnect()
    assert server.open_streams == 0


async def test_reasoning_content_comes_before_the_text(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(
        Completion(reasoning="Let me think.", text="Done.", pieces=2),
        Completion(reasoning="Hmm.", text="Whole.", usage_form="deepseek"),
    )
    deltas = _deltas(_events(await _post(client, _body("q"))))
    whole = (await _post(client, _body("q", stream=False))).json()

    assert deltas[0] == {"role": "assistant", "content": None, "reasoning_content": ""}
    assert deltas[1:3] == [
        {"content": None, "reasoning_content": "Let me "},
        {"content": None, "reasoning_content": "think."},
    ]
    assert "".join(d.get("content") or "" for d in deltas) == "Done."
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Hmm.", "Whole.")
    assert whole["usage"]["completion_tokens"] == len("Hmm.Whole.") // 4


async def test_a_cut_completion_drops_the_connection_mid_answer(
    server: ChatCompletionsServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(
        Completion(text="never finished", cut_after=2),
        Completion(text="never finished either", cut_after=0),
    )
    with pytest.raises(httpx.RemoteProtocolError):
        await _post(client, _body("q"))
    with pytest.raises(httpx.RemoteProtocolError):
        await _post(client, _body("q", stream=False))
    assert (await _post(client, _body("q"))).status_code == 200
    assert server.connections == 3
    assert server.disconnects == 0
    with pytest.raises(ValueError, match="cut_after"):
        Completion(cut_after=-1)


def _conversation(*, answered: bool) -> bytes:
    """A conversation whose assistant message asks for two calls; one or both answered."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": f"call_{n}",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                }
                for n in (1, 2)
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
    ]
    if answered:
        messages.append({"role": "tool", "tool_call_id": "call_2", "content": "two"})
    messages.append({"role": "user", "content": "and then?"})
    return json.dumps({"model": "m", "stream": False, "messages": messages}).encode()


async def test_strict_mode_refuses_a_tool_call_without_its_result_as_openai_does() -> None:
    async with ChatCompletionsServer(strict_tool_calls=True) as strict, _client(strict) as client:
        refused = await _post(client, _conversation(answered=False))
        assert refused.status_code == 400
        assert refused.json()["error"] == {
            "message": "An assistant message with 'tool_calls' must be followed by tool messages"
            " responding to each 'tool_call_id'. The following tool_call_ids did not have"
            " response messages: call_2",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
        assert (await _post(client, _conversation(answered=True))).status_code == 200
    async with ChatCompletionsServer() as lenient, _client(lenient) as client:
        assert (await _post(client, _conversation(answered=False))).status_code == 200
