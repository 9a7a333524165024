"""The chat-completions wire format, without a network: request bodies (their byte layout is
what provider prompt caches key on), the streamed-chunk assembler, usage in OpenAI's and
DeepSeek's forms, error bodies, the retry backoff and the model-spec router."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from dsh_mesh.core import (
    ChatMessage,
    InvalidArgument,
    Role,
    SessionId,
    ToolCall,
    ToolDescriptor,
    Usage,
)
from dsh_mesh.models import (
    Finished,
    FinishReason,
    ModelEvent,
    ModelRequest,
    ModelRouter,
    RetryPolicy,
    ScriptedProvider,
    TextDelta,
    ToolCallEvent,
    split_model_spec,
)
from dsh_mesh.models._openai_wire import (
    StreamAssembler,
    StreamError,
    error_of,
    request_body,
    usage_of,
)

TOOLS = (
    ToolDescriptor.of(
        "send_message",
        "Send a message to an adjacent agent.",
        {"type": "object", "properties": {"agent_id": {"type": "string"}}},
    ),
    ToolDescriptor.of("spawn_agent", "Spawn a child. Ünïcode stays.", {"type": "object"}),
)


def request(*messages: ChatMessage, model: str = "m") -> ModelRequest:
    return ModelRequest(
        session_id=SessionId("s-1"),
        model=model,
        system_prompt="You lead a team.",
        tools=TOOLS,
        messages=messages,
    )


def user(text: str) -> ChatMessage:
    return ChatMessage(role=Role.USER, content=text)


# -- request bodies ------------------------------------------------------------------------------


def test_the_body_puts_the_conversation_last_and_the_tools_verbatim_in_registry_order() -> None:
    body = request_body(request(user("Plan.")), model="gpt-x", max_output_tokens=512)
    parsed = json.loads(body)
    assert list(parsed) == ["model", "stream", "stream_options", "max_tokens", "tools", "messages"]
    assert parsed["model"] == "gpt-x" and parsed["stream"] is True
    assert parsed["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in parsed["tools"]] == ["send_message", "spawn_agent"]
    # The schema is the descriptor's canonical JSON, byte for byte.
    assert TOOLS[0].input_schema_json.encode() in body
    assert "Ünïcode".encode() in body  # UTF-8, not \\u escapes
    assert parsed["messages"][0] == {"role": "system", "content": "You lead a team."}
    assert parsed["messages"][1] == {"role": "user", "content": "Plan."}


def test_a_longer_conversation_of_one_spec_extends_the_same_bytes() -> None:
    """A fork child's request repeats its parent's head and inherited turns: same bytes up to
    the first message that differs (what a provider's prefix cache needs)."""
    turn = (
        user("Plan."),
        ChatMessage(
            role=Role.ASSISTANT,
            content="",
            tool_calls=(ToolCall(call_id="c1", name="spawn_agent", arguments_json='{"a":1}'),),
        ),
        ChatMessage(
            role=Role.TOOL, content='{"agent_id":"s-2","kind":"continuable"}', tool_call_id="c1"
        ),
        ChatMessage(role=Role.ASSISTANT, content="done"),
    )
    parent = request_body(request(*turn, user("Go on.")), model="m")
    child = request_body(request(*turn, user("Explore B.")), model="m")
    shared = request_body(request(*turn), model="m")
    assert shared.endswith(b"]}")
    prefix = shared[: -len(b"]}")]
    assert parent.startswith(prefix) and child.startswith(prefix)
    assert parent[len(prefix) :].startswith(b',{"role":"user","content":"Go on."}')


def test_assistant_tool_calls_and_tool_results_take_openai_shapes() -> None:
    call = ToolCall(call_id="call_9", name="send_message", arguments_json='{"agent_id":"s-2"}')
    body = json.loads(
        request_body(
            request(
                ChatMessage(role=Role.ASSISTANT, content="", tool_calls=(call,)),
                ChatMessage(role=Role.TOOL, content="ok", tool_call_id="call_9"),
            ),
            model="m",
        )
    )
    assistant, result = body["messages"][1:]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "send_message", "arguments": '{"agent_id":"s-2"}'},
            }
        ],
    }
    assert result == {"role": "tool", "tool_call_id": "call_9", "content": "ok"}


def test_the_output_limit_may_go_as_max_completion_tokens() -> None:
    body = request_body(
        request(user("x")),
        model="o-model",
        max_output_tokens=99,
        max_tokens_field="max_completion_tokens",
    )
    assert json.loads(body)["max_completion_tokens"] == 99
    assert b'"max_tokens"' not in body


def test_endpoint_fields_come_before_the_tools_and_may_not_replace_the_providers() -> None:
    body = json.loads(request_body(request(user("x")), model="m", extra={"temperature": 0.2}))
    assert list(body) == ["model", "stream", "stream_options", "temperature", "tools", "messages"]
    with pytest.raises(ValueError, match="messages"):
        request_body(request(user("x")), model="m", extra={"messages": []})


def test_no_tools_sends_no_tools_field() -> None:
    bare = ModelRequest(
        session_id=SessionId("s-1"), model="m", system_prompt="p", tools=(), messages=()
    )
    assert "tools" not in json.loads(request_body(bare, model="m"))


# -- streamed chunks -----------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def assemble(*payloads: Any) -> list[ModelEvent]:
    assembler = StreamAssembler()
    events: list[ModelEvent] = []
    for payload in payloads:
        events.extend(assembler.feed(payload))
    events.extend(assembler.finish())
    return events


def test_text_streams_as_it_arrives_and_usage_may_follow_the_finish() -> None:
    events = assemble(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2}},
    )
    assert events == [
        TextDelta(text="Hel"),
        TextDelta(text="lo"),
        Finished(finish_reason=FinishReason.STOP, usage=Usage(input_tokens=100, output_tokens=2)),
    ]


def test_parallel_tool_calls_are_put_together_from_pieces_even_interleaved() -> None:
    """Some servers send every call's header first and then alternate argument pieces: a call
    is whole only when the choice finishes, and calls keep the model's order."""
    assembler = StreamAssembler()
    out: list[ModelEvent] = []
    for delta in (
        {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "send_message"}}]},
        {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "spawn_agent"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
    ):
        out += assembler.feed(chunk(delta))
    assert out == []  # no call is known to be whole yet
    out += assembler.feed(chunk({}, "tool_calls"))
    out += assembler.feed({"choices": [], "usage": {"prompt_tokens": 7}})
    out += assembler.finish()
    assert out == [
        ToolCallEvent(call=ToolCall(call_id="a", name="send_message", arguments_json='{"x":1}')),
        ToolCallEvent(call=ToolCall(call_id="b", name="spawn_agent", arguments_json="{}")),
        Finished(finish_reason=FinishReason.TOOL_CALLS, usage=Usage(input_tokens=7)),
    ]


def test_tool_calls_ending_with_stop_still_finish_as_tool_calls() -> None:
    call = {"index": 0, "id": "a", "function": {"name": "t", "arguments": {"k": "v"}}}
    events = assemble(chunk({"tool_calls": [call]}), chunk({}, "stop"))
    assert events == [
        ToolCallEvent(call=ToolCall(call_id="a", name="t", arguments_json='{"k":"v"}')),
        Finished(finish_reason=FinishReason.TOOL_CALLS, usage=Usage()),
    ]


def test_the_length_finish_is_token_exhaustion() -> None:
    events = assemble(chunk({"content": "cut"}), chunk({}, "length"))
    assert events[-1] == Finished(finish_reason=FinishReason.LENGTH, usage=Usage())


def test_a_tool_call_cut_by_the_token_limit_is_dropped_not_passed_on_as_whole() -> None:
    """With ``finish_reason: length`` a call whose arguments are not complete JSON (a second
    call the limit cut, as a server that ignores ``parallel_tool_calls`` sends) never reaches
    the transcript: sent back, it would be refused. Calls that are whole are kept."""
    whole = {"index": 0, "id": "a", "function": {"name": "fork_agent", "arguments": '{"task":'}}
    events = assemble(
        chunk({"tool_calls": [whole]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Go"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "fork_agent"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"ta'}}]}),
        chunk({"tool_calls": [{"index": 2, "id": "c", "function": {"name": ""}}]}),
        chunk({}, "length"),
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
    )
    assert events == [
        ToolCallEvent(
            call=ToolCall(call_id="a", name="fork_agent", arguments_json='{"task":"Go"}')
        ),
        Finished(finish_reason=FinishReason.LENGTH, usage=Usage(input_tokens=9, output_tokens=4)),
    ]
    # Cut before its arguments began, or with no name yet: dropped as well.
    for arguments in ("", "[1,", '{"task":"Go"} trailing'):
        cut = {"index": 0, "id": "a", "function": {"name": "t", "arguments": arguments}}
        events = assemble(chunk({"tool_calls": [cut]}), chunk({}, "length"))
        assert events == [Finished(finish_reason=FinishReason.LENGTH, usage=Usage())]


def test_a_stream_without_a_finish_or_with_an_error_chunk_is_an_error() -> None:
    with pytest.raises(StreamError, match="without a finish"):
        assemble(chunk({"content": "half"}))
    with pytest.raises(StreamError, match="overloaded"):
        assemble(chunk({"content": "half"}), {"error": {"message": "overloaded", "code": "x"}})


def test_usage_in_openai_and_deepseek_forms() -> None:
    openai = {
        "prompt_tokens": 1200,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 1024},
    }
    deepseek = {
        "prompt_tokens": 1200,
        "completion_tokens": 30,
        "prompt_cache_hit_tokens": 1152,
        "prompt_cache_miss_tokens": 48,
    }
    assert usage_of(openai) == Usage(input_tokens=1200, output_tokens=30, cached_input_tokens=1024)
    assert usage_of(deepseek) == Usage(
        input_tokens=1200, output_tokens=30, cached_input_tokens=1152
    )
    assert usage_of({"prompt_tokens": 5, "prompt_tokens_details": None}) == Usage(input_tokens=5)
    assert usage_of(None) == Usage()


@pytest.mark.parametrize(
    ("body", "message", "context_length"),
    [
        (
            b'{"error":{"message":"too long","code":"context_length_exceeded"}}',
            "too long",
            True,
        ),
        (  # vLLM: no code, the message says it
            b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens.'
            b' However, you requested 5000 tokens","type":"BadRequestError","code":400}',
            "maximum context length is 4096",
            True,
        ),
        (b'{"error":"model \\"x\\" not found"}', 'model "x" not found', False),
        (b"upstream exploded", "upstream exploded", False),
        (b"", "HTTP 502", False),
    ],
)
def test_error_bodies_are_read_in_the_forms_servers_send(
    body: bytes, message: str, context_length: bool
) -> None:
    report = error_of(body, fallback="HTTP 502")
    assert message in report.message
    assert report.context_length is context_length


# -- retry backoff ---------------------------------------------------------------------------------


def test_backoff_doubles_with_equal_jitter_up_to_its_ceiling_and_honours_retry_after() -> None:
    policy = RetryPolicy(
        initial_backoff=timedelta(seconds=1), max_backoff=timedelta(seconds=4), max_attempts=9
    )
    rng = random.Random(7)
    for retry, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0), (8, 4.0)]:
        waits = [policy.backoff(retry, rng=rng) for _ in range(200)]
        assert ceiling / 2 <= min(waits) and max(waits) <= ceiling
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not fixed
    assert policy.backoff(1, retry_after=30, rng=rng) == 30


def test_a_retry_policy_refuses_impossible_settings() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy(initial_backoff=timedelta(seconds=5), max_backoff=timedelta(seconds=1))


# -- the router ----------------------------------------------------------------------------------


class Named:
    def __init__(self, name: str) -> None:
        self.name = name
        self.models: list[str] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.models.append(request.model)
        yield Finished(finish_reason=FinishReason.STOP, usage=Usage())


@pytest.mark.parametrize(
    ("spec", "served_by", "model"),
    [
        ("openai:gpt-4o-mini", "openai", "gpt-4o-mini"),
        ("ollama:qwen2.5:7b", "ollama", "qwen2.5:7b"),  # the model keeps its own colons
        ("lead", "scripted", "lead"),
        ("nobody:thing", "scripted", "nobody:thing"),  # not a configured endpoint
    ],
)
async def test_a_model_spec_picks_its_provider_and_the_model_it_asks_for(
    spec: str, served_by: str, model: str
) -> None:
    providers = {name: Named(name) for name in ("openai", "ollama", "scripted")}
    router = ModelRouter(
        {"openai": providers["openai"], "ollama": providers["ollama"]},
        default=providers["scripted"],
    )
    events = [e async for e in router.stream(request(user("x"), model=spec))]
    assert len(events) == 1
    assert providers[served_by].models == [model]
    assert sum(len(p.models) for p in providers.values()) == 1


def test_a_spec_naming_an_endpoint_nobody_configured_is_refused() -> None:
    scripted = ScriptedProvider()
    scripted.program("odd:but-scripted")
    router = ModelRouter({"ollama": Named("ollama")}, default=scripted)
    router.check("ollama:qwen2.5:7b")
    router.check("lead")  # no endpoint named: the scripted programs' business
    router.check("odd:but-scripted")  # the default provider serves it
    with pytest.raises(InvalidArgument, match="'olama', which is not configured"):
        router.check("olama:qwen2.5:7b")
    # A default provider that cannot say what it serves may serve any spec.
    ModelRouter({}, default=Named("custom")).check("anything:goes")


def test_a_model_spec_splits_at_its_first_colon() -> None:
    assert split_model_spec("ollama:qwen2.5:7b") == ("ollama", "qwen2.5:7b")
    assert split_model_spec("openai:") == ("openai", "")
    assert split_model_spec("lead") is None


# -- what a hostile or broken endpoint sends (ADR 0038) -------------------------------------------


def test_ids_names_and_indexes_of_the_wrong_type_never_break_the_stream() -> None:
    """An id or a name that is no string, an index that is no number: the call is still put
    together (an id the agent then replaces, a name that names no tool), never a TypeError."""
    events = assemble(
        chunk({"tool_calls": [{"index": 0, "id": 7, "function": {"name": ["t"]}}]}),
        chunk({"tool_calls": [{"index": "1", "id": None, "function": {"name": "u"}}]}),
        chunk({"tool_calls": [{"index": 2, "id": "c", "function": "nonsense"}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}", "name": 3}}]}),
        chunk({}, "tool_calls"),
    )
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert all(isinstance(c.call_id, str) and isinstance(c.name, str) for c in calls)
    assert [c.name for c in calls] == ["", "u", ""]
    assert calls[0].arguments_json == "{}"


def test_arguments_nested_100_000_deep_cut_by_the_token_limit_are_dropped_not_a_crash() -> None:
    deep = '{"a": ' * 100_000
    call = {"index": 0, "id": "a", "function": {"name": "t", "arguments": deep}}
    events = assemble(chunk({"tool_calls": [call]}), chunk({}, "length"))
    assert events == [Finished(finish_reason=FinishReason.LENGTH, usage=Usage())]
    whole = {
        "index": 0,
        "id": "a",
        "function": {"name": "t", "arguments": deep + "1" + "}" * 100_000},
    }
    events = assemble(chunk({"tool_calls": [whole]}), chunk({}, "length"))
    assert events == [Finished(finish_reason=FinishReason.LENGTH, usage=Usage())]


def test_a_chunk_nested_100_000_deep_is_a_typed_stream_error() -> None:
    from dsh_mesh.models._openai import _parse

    with pytest.raises(StreamError, match="nested deeper"):
        _parse("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StreamError, match="not JSON"):
        _parse("{nope" + "x" * 100_000)
