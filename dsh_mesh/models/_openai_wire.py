"""The OpenAI chat-completions wire format: request bodies and streamed chunks.

Pure functions and one small assembler, no I/O, so the byte layout that provider prompt caches
key on is stated (and tested) in one place:

- The body's fields come in a fixed order with the conversation last: ``model``, ``stream``,
  ``stream_options``, ``max_tokens`` (or ``max_completion_tokens``), any extra endpoint
  fields, ``tools``, ``messages`` (system prompt first). Two requests of one spec (a parent
  and its fork child) are therefore byte-identical from the first byte through the last
  message they share. A compaction's summary request (``CallPurpose.COMPACTION``) is a step's
  request with one more message, then ``"tool_choice":"none"`` after the messages, so it shares
  the step's bytes through the conversation.
- JSON is compact (``,`` and ``:``), UTF-8, with non-ASCII text kept as is; tool schemas are
  the descriptors' canonical JSON, inserted verbatim.

Usage is read in OpenAI's form (``usage.prompt_tokens_details.cached_tokens``) and DeepSeek's
(``usage.prompt_cache_hit_tokens``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsh_mesh.core import (
    ChatMessage,
    InvalidArgument,
    Role,
    ToolCall,
    ToolDescriptor,
    Usage,
    parse_bounded,
)
from dsh_mesh.models._protocol import (
    CallPurpose,
    Finished,
    FinishReason,
    ModelEvent,
    ModelRequest,
    TextDelta,
    ToolCallEvent,
)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,
    "length": FinishReason.LENGTH,
    "content_filter": FinishReason.STOP,
}

_CONTEXT_LENGTH = re.compile(
    r"context[ _]length|context window|maximum context|prompt is too long|too many tokens"
    r"|exceeds the (model's )?max",
    re.IGNORECASE,
)


def request_body(
    request: ModelRequest,
    *,
    model: str,
    extra: Mapping[str, Any] | None = None,
    max_output_tokens: int | None = None,
    max_tokens_field: str = "max_tokens",
    output_schema: str = "",
) -> bytes:
    """The streamed chat-completions body of ``request``, for the endpoint's ``model`` name;
    with ``output_schema`` (canonical JSON) it asks for answers in that schema.

    The parts that vary per call come last, so equal heads make equal byte prefixes."""
    head = [
        "{",
        _pair("model", model),
        ",",
        '"stream":true,"stream_options":{"include_usage":true}',
    ]
    if max_output_tokens is not None:
        head += [",", _pair(max_tokens_field, max_output_tokens)]
    for name, value in (extra or {}).items():
        if name in RESERVED_FIELDS:
            raise ValueError(f"the endpoint field {name!r} is set by the provider itself")
        head += [",", _pair(name, value)]
    if request.tools:
        head += [',"tools":[', ",".join(_tool(t) for t in request.tools), "]"]
    messages = [_dumps({"role": "system", "content": request.system_prompt})]
    encoded: dict[ChatMessage, str] = request.memo.setdefault(_ENCODED, {})
    for message in request.messages:
        text = encoded.get(message)
        if text is None:
            text = encoded[message] = _message(message)
        messages.append(text)
    head += [',"messages":[', ",".join(messages), "]"]
    if request.purpose is CallPurpose.COMPACTION and request.tools:
        head.append(',"tool_choice":"none"')
    elif output_schema and request.purpose is CallPurpose.STEP:
        head += [
            ',"response_format":{"type":"json_schema","json_schema":{"name":"answer","schema":',
            output_schema,
            "}}",
        ]
    head.append("}")
    return "".join(head).encode()


_ENCODED = "openai.messages"
"""The key of a request's memo under which each message's encoding is kept."""

RESERVED_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "messages",
        "response_format",
    }
)
"""Body fields the provider sets itself; an endpoint's extra fields may not replace them."""


def _tool(descriptor: ToolDescriptor) -> str:
    # The schema is the descriptor's canonical JSON, inserted as is (never re-serialised).
    return (
        '{"type":"function","function":{'
        + _pair("name", descriptor.name)
        + ","
        + _pair("description", descriptor.description)
        + ',"parameters":'
        + descriptor.input_schema_json
        + "}}"
    )


def _message(message: ChatMessage) -> str:
    if message.role is Role.TOOL:
        return _dumps(
            {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
        )
    if message.role is Role.ASSISTANT and message.tool_calls:
        return _dumps(
            {
                "role": "assistant",
                "content": message.content or None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                    for call in message.tool_calls
                ],
            }
        )
    return _dumps({"role": message.role.value, "content": message.content})


def _pair(name: str, value: Any) -> str:
    return f"{_dumps(name)}:{_dumps(value)}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def usage_of(payload: Mapping[str, Any] | None) -> Usage:
    """The usage a response reports, in OpenAI's or DeepSeek's form (zero where absent)."""
    if not isinstance(payload, Mapping):
        return Usage()
    details = payload.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if cached is None:
        cached = payload.get("prompt_cache_hit_tokens")
    return Usage(
        input_tokens=_count(payload.get("prompt_tokens")),
        output_tokens=_count(payload.get("completion_tokens")),
        cached_input_tokens=_count(cached),
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0


@dataclass(frozen=True, kw_only=True)
class ErrorReport:
    """What an endpoint said when it refused or failed a request."""

    message: str
    code: str = ""

    @property
    def context_length(self) -> bool:
        """The prompt does not fit the model's context: the turn's tokens are exhausted."""
        return self.code == "context_length_exceeded" or bool(_CONTEXT_LENGTH.search(self.message))


def error_of(body: bytes | str, *, fallback: str) -> ErrorReport:
    """Read an error body (``{"error": {"message", "code"}}``, or ``{"error": "text"}`` as some
    servers send, or plain text)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return ErrorReport(message=text.strip()[:2000] or fallback)
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or fallback
        code = error.get("code") or error.get("type") or ""
        return ErrorReport(message=str(message)[:2000], code=str(code))
    return ErrorReport(message=str(error)[:2000] or fallback)


class StreamError(Exception):
    """The endpoint reported an error inside the stream, or sent what no chunk can be."""

    def __init__(self, report: ErrorReport) -> None:
        super().__init__(report.message)
        self.report = report


@dataclass
class _PartialCall:
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def whole(self) -> ToolCall:
        return ToolCall(
            call_id=self.call_id, name=self.name, arguments_json="".join(self.arguments)
        )

    def complete(self) -> bool:
        """Named, with arguments that are one whole JSON object (of bounded depth: any
        arguments the agent would refuse count as cut)."""
        try:
            arguments = parse_bounded("".join(self.arguments))
        except InvalidArgument:
            return False
        return bool(self.name) and isinstance(arguments, dict)


def _index(value: Any, position: int) -> int:
    """A tool call's place in its choice: the ``index`` sent (a number, or digits), else its
    position in the chunk."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit() and len(value) < 10:
        return int(value)
    return position


@dataclass
class StreamAssembler:
    """Turns the parsed ``data:`` payloads of one streamed response into model events.

    Text is forwarded as it arrives. Tool calls are emitted, in index order, once the choice
    finishes: only then is each whole, since some servers interleave the argument pieces of
    parallel calls. When the choice finishes at the token limit (``length``), a call without a
    name or whose arguments are not one whole JSON object was cut off and is dropped: sent
    back in the transcript it would be refused (llama.cpp answers HTTP 500), and it was never
    what the model meant. Usage may come with the finishing chunk or after it."""

    _calls: dict[int, _PartialCall] = field(default_factory=dict)
    _emitted: int = 0
    _finish: FinishReason | None = None
    _usage: Usage = field(default_factory=Usage)
    _done: bool = False

    def feed(self, payload: Any) -> Iterator[ModelEvent]:
        """The events one chunk completes."""
        if self._done:
            return
        if not isinstance(payload, dict):
            raise StreamError(ErrorReport(message=f"a stream chunk is not an object: {payload!r}"))
        if "error" in payload:
            raise StreamError(error_of(json.dumps(payload), fallback="error in the stream"))
        if isinstance(payload.get("usage"), Mapping):
            self._usage = usage_of(payload["usage"])
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            content = delta.get("content")
            if isinstance(content, str) and content:
                yield TextDelta(text=content)
            for position, piece in enumerate(delta.get("tool_calls") or ()):
                self._call_piece(position, piece)
            reason = choice.get("finish_reason")
            if reason:
                self._finish = _FINISH_REASONS.get(reason, FinishReason.STOP)
                yield from self._flush()

    def _call_piece(self, position: int, piece: Any) -> None:
        # An endpoint may send anything: an id, a name or an index of the wrong type never
        # breaks the stream. The agent bounds and checks what comes out (ADR 0038).
        if not isinstance(piece, dict):
            return
        index = _index(piece.get("index", position), position)
        function = piece.get("function")
        if not isinstance(function, dict):
            function = {}
        given_id, name = piece.get("id"), function.get("name")
        name = name if isinstance(name, str) else ""
        partial = self._calls.get(index)
        if partial is None:
            call_id = given_id if isinstance(given_id, str) and given_id else f"call_{index}"
            partial = _PartialCall(call_id=call_id, name=name)
            self._calls[index] = partial
        elif name and not partial.name:
            partial.name = name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            partial.arguments.append(arguments)
        elif arguments is not None:  # some servers send the arguments as an object
            partial.arguments.append(_dumps(arguments))

    def _flush(self) -> Iterator[ModelEvent]:
        cut = self._finish is FinishReason.LENGTH
        for index in sorted(self._calls):
            if index >= self._emitted:
                partial = self._calls[index]
                self._emitted = index + 1
                if cut and not partial.complete():
                    continue  # cut off by the token limit: never passed on as if whole
                yield ToolCallEvent(call=partial.whole())

    def finish(self) -> Iterator[ModelEvent]:
        """The last events, once the stream ended (``[DONE]`` or end of body)."""
        if self._done:
            return
        self._done = True
        yield from self._flush()
        reason = self._finish
        if reason is None:
            raise StreamError(ErrorReport(message="the stream ended without a finish reason"))
        if self._calls and reason is FinishReason.STOP:
            reason = FinishReason.TOOL_CALLS  # some servers say "stop" after tool calls
        yield Finished(finish_reason=reason, usage=self._usage)
