"""What a test scripts the chat-completions server to answer, what the server records, and the
chat-completions payloads built from them, with no I/O.

A test scripts a :class:`Completion` (text and tool calls, streamed as server-sent events or
returned whole), a :class:`Failure` (an HTTP error with OpenAI's error body and an optional
``Retry-After``) or a :class:`Stall` (a stream that starts and then goes silent until the client
gives up), or a :data:`Responder` that chooses one per request. Every request is kept byte-exact
as a :class:`RecordedRequest`. The builders here shape the whole completion, the stream's SSE
events, usage objects and error bodies the way OpenAI, vLLM and DeepSeek do.

Token accounting is a deliberate, documented approximation so tests can predict it:

- ``prompt_tokens`` is the request body's length in bytes divided by 4, rounded up.
- Cached prompt tokens simulate a provider's prefix cache: the longest common *byte* prefix of
  this body and any earlier body the server answered with a :class:`Completion` or
  :class:`Stall`, divided by 4 (rounded down), rounded down to a multiple of
  ``cache_block_tokens`` (16 by default, as providers cache in blocks), and never more than
  ``prompt_tokens``. The first request therefore has 0 cached tokens.
- ``completion_tokens`` is :attr:`Completion.completion_tokens` when given, else the length in
  characters of the reasoning, the text and every tool call's arguments, divided by 4 (rounded
  down), at least 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, TypeAlias

BYTES_PER_TOKEN = 4
_FINGERPRINT = "fp_dsh_mesh"

UsageForm: TypeAlias = Literal["openai", "deepseek", "vllm", "none"]
"""How a :class:`Completion` reports usage: ``"openai"`` (``prompt_tokens_details.cached_tokens``),
``"deepseek"`` (``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``), ``"vllm"``
(``prompt_tokens_details`` is ``null``) or ``"none"`` (no usage at all)."""

_USAGE_FORMS: frozenset[str] = frozenset({"openai", "deepseek", "vllm", "none"})


@dataclass(frozen=True, kw_only=True)
class ScriptedToolCall:
    """One tool call a :class:`Completion` makes: ``arguments`` is the raw JSON text, sent as
    is (it is not checked, so a test may send malformed arguments on purpose)."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A successful answer: ``reasoning``, ``text`` then ``tool_calls``, ending with
    ``finish_reason``.

    - ``finish_reason`` defaults to ``"tool_calls"`` when there are tool calls, else
      ``"stop"``; any string is sent as given (``"length"``, ``"content_filter"``).
    - ``usage_form`` picks the usage shape (see :data:`UsageForm`); ``completion_tokens``
      overrides the derived count (see the module docstring).
    - Streamed, the reasoning, the text and each call's arguments are split into ``pieces``
      chunks each (fewer when shorter). Tool calls go one after another, as OpenAI sends them;
      with ``interleave`` every call's header goes first and the argument pieces of the calls
      then alternate, as some servers do.
    - ``reasoning`` is sent as ``reasoning_content`` (DeepSeek's reasoner, vLLM's reasoning
      parsers): streamed as deltas ``{"content": null, "reasoning_content": piece}`` before
      the text, whole as ``message.reasoning_content``.
    - ``cut_after`` drops the connection mid-answer: streamed, only the first ``cut_after``
      SSE events are sent (the role chunk is the first, ``[DONE]`` the last) and the
      connection is closed without ending the chunked body; not streamed, the head and half
      the JSON body are sent, then the connection is closed. A cut is the server's doing and
      is not counted in :attr:`ChatCompletionsServer.disconnects`.

    Raises ``ValueError`` for ``pieces < 1``, an unknown usage form or a negative count.
    """

    text: str = ""
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    finish_reason: str | None = None
    usage_form: UsageForm = "openai"
    completion_tokens: int | None = None
    pieces: int = 3
    interleave: bool = False
    reasoning: str = ""
    cut_after: int | None = None

    def __post_init__(self) -> None:
        if self.pieces < 1:
            raise ValueError(f"pieces must be at least 1, got {self.pieces}")
        if self.usage_form not in _USAGE_FORMS:
            raise ValueError(f"usage_form must be one of {sorted(_USAGE_FORMS)}")
        if self.completion_tokens is not None and self.completion_tokens < 0:
            raise ValueError("completion_tokens must not be negative")
        if self.cut_after is not None and self.cut_after < 0:
            raise ValueError("cut_after must not be negative")

    @property
    def reason(self) -> str:
        """The finish reason sent: ``finish_reason`` or its default."""
        if self.finish_reason is not None:
            return self.finish_reason
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def output_tokens(self) -> int:
        """The ``completion_tokens`` reported: the override or the derived count."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        chars = len(self.reasoning) + len(self.text)
        chars += sum(len(call.arguments) for call in self.tool_calls)
        return max(1, chars // BYTES_PER_TOKEN)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """An HTTP error answer: ``status`` with OpenAI's body
    ``{"error": {"message", "type", "param", "code"}}``.

    ``message`` defaults to a provider-like text for the status. ``error_type`` defaults to
    ``"requests"`` for 429 (OpenAI's rate-limit type), ``"server_error"`` for 5xx and
    ``"invalid_request_error"`` otherwise. ``retry_after`` (seconds) is sent as a
    ``Retry-After`` header: an integer when whole, else a decimal such as ``0.25``. Raises
    ``ValueError`` for a status outside 400-599 or a negative ``retry_after``.
    """

    status: int
    message: str = ""
    code: str | None = None
    retry_after: float | None = None
    error_type: str | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"a Failure's status must be 400-599, got {self.status}")
        if self.retry_after is not None and self.retry_after < 0:
            raise ValueError("retry_after must not be negative")

    def body(self) -> dict[str, Any]:
        """The JSON error object sent."""
        return error_body(
            self.message or _default_message(self.status),
            error_type=self.error_type or _default_type(self.status),
            code=self.code,
            param=self.param,
        )


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Send the response head and the first text chunk, then hang until the client goes away.

    Streamed, the client receives the head, a chunk with ``role: "assistant"`` and a chunk with
    ``text`` as content, then nothing. Not streamed, it receives nothing at all. Either way the
    server waits (without polling) for the client to close the connection and counts it in
    :attr:`ChatCompletionsServer.disconnects`.
    """

    text: str = "..."


Reply: TypeAlias = Completion | Failure | Stall
"""What the server answers one chat-completions request with."""


@dataclass(frozen=True, kw_only=True)
class RecordedRequest:
    """One HTTP request as the server received it.

    ``headers`` has lower-case names (repeated headers joined with ``", "``); ``body`` is the
    body exactly as received (de-chunked when it came chunked); ``json`` is the parsed body, or
    None when it is empty or not JSON. ``connection`` numbers the TCP connection it came on
    (1 for the server's first), so a test can tell keep-alive reuse from new connections.
    """

    method: str
    path: str
    query: str = ""
    headers: Mapping[str, str] = field(hash=False)
    body: bytes
    json: Any = field(hash=False)
    connection: int

    @property
    def model(self) -> str | None:
        """The body's ``model``, if it is a string."""
        value = self._field("model")
        return value if isinstance(value, str) else None

    @property
    def messages(self) -> list[Any]:
        """The body's ``messages`` (empty if absent or not a list)."""
        value = self._field("messages")
        return value if isinstance(value, list) else []

    @property
    def tools(self) -> list[Any]:
        """The body's ``tools`` (empty if absent or not a list)."""
        value = self._field("tools")
        return value if isinstance(value, list) else []

    @property
    def stream(self) -> bool:
        """Whether the body asks for a streamed answer (``"stream": true``)."""
        return self._field("stream") is True

    @property
    def include_usage(self) -> bool:
        """Whether the body asks for a usage chunk (``stream_options.include_usage``)."""
        options = self._field("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def _field(self, name: str) -> Any:
        return self.json.get(name) if isinstance(self.json, dict) else None


Responder: TypeAlias = Callable[[RecordedRequest], Reply | Awaitable[Reply]]
"""Chooses the reply to a chat-completions request; may be a coroutine function."""


# -- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ChatAnswer:
    """A chat-completions request the server will answer with a completion or a stall,
    with the ids and token counts its payloads carry."""

    request: RecordedRequest
    reply: Completion | Stall
    completion_id: str
    model: str
    created: int
    prompt_tokens: int
    cached_tokens: int


DONE = b"data: [DONE]\n\n"


def error_body(
    message: str, *, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _default_type(status: int) -> str:
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


def _default_message(status: int) -> str:
    if status == 429:
        return "Rate limit reached for requests. Please try again later."
    if status == 500:
        return "The server had an error while processing your request. Sorry about that!"
    if status == 503:
        return "The engine is currently overloaded, please try again later."
    return phrase(status)


def phrase(status: int) -> str:
    """The reason phrase of an HTTP status (``"Unknown"`` for one it does not know)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _usage(answer: ChatAnswer, completion: Completion) -> dict[str, Any] | None:
    prompt, cached = answer.prompt_tokens, answer.cached_tokens
    output = completion.output_tokens
    counts: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
    }
    form = completion.usage_form
    if form == "none":
        return None
    if form == "deepseek":
        return counts | {
            "prompt_cache_hit_tokens": cached,
            "prompt_cache_miss_tokens": prompt - cached,
        }
    if form == "vllm":
        return counts | {"prompt_tokens_details": None}
    return counts | {
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": len(completion.reasoning) // BYTES_PER_TOKEN,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def whole_completion(answer: ChatAnswer, completion: Completion) -> dict[str, Any]:
    """The JSON body of a completion that is not streamed."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": completion.text if completion.text or not completion.tool_calls else None,
        "refusal": None,
    }
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in completion.tool_calls
        ]
    body: dict[str, Any] = {
        "id": answer.completion_id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": completion.reason}
        ],
    }
    usage = _usage(answer, completion)
    if usage is not None:
        body["usage"] = usage
    body["system_fingerprint"] = _FINGERPRINT
    return body


def chunk(answer: ChatAnswer, delta: dict[str, Any], *, finish_reason: str | None = None) -> bytes:
    """One SSE event carrying a ``chat.completion.chunk`` with ``delta``."""
    body: dict[str, Any] = {
        "id": answer.completion_id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
        "system_fingerprint": _FINGERPRINT,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if answer.request.include_usage:
        body["usage"] = None  # OpenAI's shape: every chunk but the last carries usage null
    return b"data: " + dumps(body) + b"\n\n"


def stream_chunks(answer: ChatAnswer, completion: Completion) -> list[bytes]:
    """The SSE events of a streamed completion, without the final ``[DONE]``."""
    deltas = list(_deltas(completion))
    first: dict[str, Any] = {"role": "assistant", "content": "", "refusal": None}
    if completion.reasoning:
        first = {"role": "assistant", "content": None, "reasoning_content": ""}
    elif not completion.text and completion.tool_calls:
        # OpenAI puts the role on the first tool-call chunk when there is no text.
        first = {"role": "assistant", "content": None, "refusal": None} | deltas.pop(0)
    events = [chunk(answer, first)]
    events += [chunk(answer, delta) for delta in deltas]
    events.append(chunk(answer, {}, finish_reason=completion.reason))
    usage = _usage(answer, completion)
    if answer.request.include_usage and usage is not None:
        final = {
            "id": answer.completion_id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "system_fingerprint": _FINGERPRINT,
            "choices": [],
            "usage": usage,
        }
        events.append(b"data: " + dumps(final) + b"\n\n")
    return events


def _deltas(completion: Completion) -> Iterator[dict[str, Any]]:
    """The reasoning deltas, the content deltas of the text, then the tool-call deltas."""
    for piece in _split(completion.reasoning, completion.pieces):
        yield {"content": None, "reasoning_content": piece}
    for piece in _split(completion.text, completion.pieces):
        yield {"content": piece}
    headers = [
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        }
        for index, call in enumerate(completion.tool_calls)
    ]
    arguments = [
        [
            {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
            for piece in _split(call.arguments, completion.pieces)
        ]
        for index, call in enumerate(completion.tool_calls)
    ]
    if completion.interleave:
        yield from headers
        for round_ in range(max((len(pieces) for pieces in arguments), default=0)):
            for pieces in arguments:
                if round_ < len(pieces):
                    yield pieces[round_]
        return
    for header, pieces in zip(headers, arguments, strict=True):
        yield header
        yield from pieces


def _split(text: str, pieces: int) -> list[str]:
    """``text`` cut into at most ``pieces`` non-empty, nearly equal parts (none if empty)."""
    if not text:
        return []
    size = math.ceil(len(text) / pieces)
    return [text[start : start + size] for start in range(0, len(text), size)]


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, as the server sends it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def parse_json(body: bytes) -> Any:
    """The parsed body, or None when it is empty or not JSON."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:  # UnicodeDecodeError is one too
        return None


def common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (a binary search over slice
    comparisons, which run in C)."""
    low, high = 0, min(len(a), len(b))
    view_a, view_b = memoryview(a), memoryview(b)
    while low < high:
        middle = (low + high + 1) // 2
        if view_a[:middle] == view_b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
