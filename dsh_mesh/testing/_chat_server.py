"""A local HTTP server that speaks the OpenAI chat-completions protocol, for tests.

:class:`ChatCompletionsServer` listens on ``127.0.0.1`` and a free port and answers
``POST /v1/chat/completions`` the way OpenAI, vLLM and DeepSeek do, from replies a test scripts:
a :class:`Completion` (text and tool calls, streamed as server-sent events or returned whole), a
:class:`Failure` (an HTTP error with OpenAI's error body and an optional ``Retry-After``) or a
:class:`Stall` (a stream that starts and then goes silent until the client gives up). Every
request is kept byte-exact as a :class:`RecordedRequest`, recorded before it is answered.

It is plain asyncio streams, HTTP/1.1 with keep-alive: request bodies by ``Content-Length`` or
``Transfer-Encoding: chunked``, streamed responses chunked, one SSE event per HTTP chunk.

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

import asyncio
import contextlib
import inspect
import json
import math
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from types import MappingProxyType, TracebackType
from typing import Any, Literal, Self, TypeAlias
from urllib.parse import urlsplit

_LOOPBACK = "127.0.0.1"
_BYTES_PER_TOKEN = 4
_DEFAULT_MODEL = "test-model"
_FINGERPRINT = "fp_dsh_mesh"
_HEAD_LINE_LIMIT = 1 << 16
_MAX_BODY = 1 << 28
_READ_SIZE = 1 << 16
_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MODEL_PATHS = frozenset({"/v1/models", "/models"})

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
        return max(1, chars // _BYTES_PER_TOKEN)


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
        return _error_body(
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


class ChatCompletionsServer:
    """An OpenAI-compatible chat-completions endpoint on ``127.0.0.1`` and a free port.

    Each valid ``POST /v1/chat/completions`` (``/chat/completions`` works too) is answered by
    the next reply :meth:`enqueue`\\ d, else by ``responder(request)`` (a plain or coroutine
    function), else by ``Completion(text="ok")``. Before that, in this order, the server
    refuses: a missing or wrong ``Authorization: Bearer <api_key>`` when ``api_key`` is set
    (401, code ``"invalid_api_key"``; this applies to every path); a body that is not a JSON
    object (400); a missing ``model`` or ``messages`` (400); a prompt longer than
    ``max_context_tokens`` (400, code ``"context_length_exceeded"``, OpenAI's message). A
    responder that raises gets a 500 with the exception's text, and the server keeps serving.
    ``GET /v1/models`` lists the models requested so far (or ``"test-model"``); anything else
    is a 404 with an error body. Token accounting is in the module docstring.

    Lifecycle: :meth:`start` returns once the server listens (then :attr:`base_url` is valid);
    :meth:`shutdown` closes the listener and every connection and waits for their handlers; it
    is idempotent and safe in ``finally``; ``async with`` does both. A server runs once. All
    methods must be called from the event loop that started it.
    """

    def __init__(
        self,
        responder: Responder | None = None,
        *,
        max_context_tokens: int | None = None,
        api_key: str | None = None,
        cache_block_tokens: int = 16,
    ) -> None:
        """Prepare a server; nothing listens until :meth:`start`. Raises ``ValueError`` for a
        ``max_context_tokens`` or ``cache_block_tokens`` below 1."""
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError("max_context_tokens must be at least 1")
        if cache_block_tokens < 1:
            raise ValueError("cache_block_tokens must be at least 1")
        self._responder = responder
        self._max_context_tokens = max_context_tokens
        self._api_key = api_key
        self._cache_block_tokens = cache_block_tokens
        self._queue: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._served_bodies: list[bytes] = []
        self._models: dict[str, None] = {}
        self._answers = 0
        self._connections = 0
        self._disconnects = 0
        self._open_streams = 0
        self._changed = asyncio.Event()
        self._listener: asyncio.Server | None = None
        self._runner: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._port: int | None = None
        self._started = False
        self._crash_reported = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind ``127.0.0.1:0`` and return once connections are accepted.

        Raises ``RuntimeError`` if the server was started or shut down before (a server runs
        once)."""
        if self._started or self._stopping.is_set():
            raise RuntimeError("ChatCompletionsServer.start: a server starts once")
        self._started = True
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((_LOOPBACK, 0))
        except OSError:
            sock.close()
            raise
        self._port = int(sock.getsockname()[1])
        # The runner owns the connection handlers' task group; shutdown() awaits it.
        self._runner = asyncio.create_task(self._run(), name="chat-completions-server")
        try:
            await self._ready.wait()
            self._listener = await asyncio.start_server(
                self._accept, sock=sock, limit=_HEAD_LINE_LIMIT
            )
        finally:
            if self._listener is None:  # start_server did not take the socket over
                sock.close()

    async def shutdown(self) -> None:
        """Stop listening, close every connection (a stalled stream included) and wait for
        their handlers to end.

        Idempotent, and a no-op on a server that never started. Re-raises, once, an error that
        crashed a connection handler (a bug in this server), so a test does not pass over it.
        """
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        runner = self._runner
        if runner is not None:
            await asyncio.wait({runner})
        if listener is not None:
            await listener.wait_closed()
        if runner is not None and not self._crash_reported and not runner.cancelled():
            self._crash_reported = True
            error = runner.exception()
            if error is not None:
                raise error

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    # -- where and what -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the server listens on; ``RuntimeError`` before :meth:`start`."""
        if self._port is None:
            raise RuntimeError("ChatCompletionsServer was never started: it has no port yet")
        return self._port

    @property
    def base_url(self) -> str:
        """``"http://127.0.0.1:<port>/v1"``: the base URL an OpenAI client is given."""
        return f"http://{_LOOPBACK}:{self.port}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, of any path, in arrival order (a copy)."""
        return list(self._requests)

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        return self._connections

    @property
    def disconnects(self) -> int:
        """Responses the client abandoned before their end: every :class:`Stall` whose client
        went away, and (best effort) streamed completions whose client closed mid-stream."""
        return self._disconnects

    @property
    def open_streams(self) -> int:
        """Streamed responses being written (or stalled) right now."""
        return self._open_streams

    @property
    def queued(self) -> int:
        """Replies enqueued and not used yet."""
        return len(self._queue)

    def enqueue(self, *replies: Reply) -> None:
        """Append replies to the FIFO queue; each answers one chat-completions request that
        passed validation, before the responder is consulted."""
        for reply in replies:
            if not isinstance(reply, Completion | Failure | Stall):
                raise TypeError(f"not a Reply: {reply!r}")
        self._queue.extend(replies)

    async def wait_disconnect(self, count: int = 1) -> None:
        """Return once :attr:`disconnects` is at least ``count``. Never times out by itself:
        bound it (``asyncio.timeout``)."""
        await self._wait_until(lambda: self._disconnects >= count)

    async def wait_requests(self, count: int = 1) -> None:
        """Return once at least ``count`` requests were recorded. Never times out by itself."""
        await self._wait_until(lambda: len(self._requests) >= count)

    # -- internals: connections -----------------------------------------------------------------

    async def _wait_until(self, done: Callable[[], bool]) -> None:
        while True:
            changed = self._changed
            if done():
                return
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self._ready.set()
                await self._stopping.wait()
                for handler in list(self._handlers):
                    handler.cancel()
        finally:
            self._group = None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain function, so asyncio makes no task of its own: the handler belongs to our group.
        group = self._group
        if group is None or self._stopping.is_set():
            writer.close()
            return
        self._connections += 1
        handler = group.create_task(self._serve(reader, writer, self._connections))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: int
    ) -> None:
        try:
            while await self._exchange(reader, writer, connection):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-request or mid-answer: nobody is left to answer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: int
    ) -> bool:
        """Read one request and answer it; whether the connection stays open for another."""
        try:
            head = await _read_head(reader)
            if head is None:
                return False
            if head.headers.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await _read_body(reader, head.headers)
        except _BadRequest as bad:
            body_json = _error_body(str(bad), error_type="invalid_request_error")
            await self._send_json(writer, 400, body_json, keep_alive=False)
            return False
        target = urlsplit(head.target)
        request = RecordedRequest(
            method=head.method,
            path=target.path or "/",
            query=target.query,
            headers=MappingProxyType(head.headers),
            body=body,
            json=_parse_json(body),
            connection=connection,
        )
        self._requests.append(request)
        self._notify()
        answer = await self._route(request)
        if isinstance(answer, _JsonAnswer):
            await self._send_json(
                writer, answer.status, answer.body, keep_alive=head.keep_alive, extra=answer.extra
            )
            return head.keep_alive
        if isinstance(answer.reply, Stall):
            await self._stall(answer, reader, writer)
            return False
        if answer.request.stream:
            finished = await self._stream(
                answer, answer.reply, reader, writer, keep_alive=head.keep_alive
            )
            return finished and head.keep_alive
        cut = answer.reply.cut_after is not None
        await self._send_json(
            writer,
            200,
            _whole_completion(answer, answer.reply),
            keep_alive=head.keep_alive,
            cut=cut,
        )
        return head.keep_alive and not cut

    # -- internals: what to answer --------------------------------------------------------------

    async def _route(self, request: RecordedRequest) -> _JsonAnswer | _ChatAnswer:
        if self._api_key is not None and not self._authorized(request):
            return _JsonAnswer(
                status=401,
                body=_error_body(
                    "Incorrect API key provided. You can find your API key at"
                    " https://platform.openai.com/account/api-keys.",
                    error_type="invalid_request_error",
                    code="invalid_api_key",
                ),
            )
        if request.path in _CHAT_PATHS and request.method == "POST":
            return await self._chat(request)
        if request.path in _MODEL_PATHS and request.method == "GET":
            models = list(self._models) or [_DEFAULT_MODEL]
            listed = [
                {"id": model, "object": "model", "created": 0, "owned_by": "dsh-mesh"}
                for model in models
            ]
            return _JsonAnswer(status=200, body={"object": "list", "data": listed})
        return _JsonAnswer(
            status=404,
            body=_error_body(
                f"Invalid URL ({request.method} {request.path})",
                error_type="invalid_request_error",
            ),
        )

    def _authorized(self, request: RecordedRequest) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and token.strip() == self._api_key

    async def _chat(self, request: RecordedRequest) -> _JsonAnswer | _ChatAnswer:
        payload = request.json
        if not isinstance(payload, dict):
            return _refuse(
                400,
                "We could not parse the JSON body of your request. (HINT: This likely means"
                " you aren't using your HTTP library correctly. The OpenAI API expects a JSON"
                " payload, but what was sent was not valid JSON.)",
            )
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return _refuse(400, "you must provide a model parameter")
        if not isinstance(payload.get("messages"), list):
            return _refuse(
                400,
                "Missing required parameter: 'messages'.",
                param="messages",
                code="missing_required_parameter",
            )
        self._models.setdefault(model)
        prompt_tokens = math.ceil(len(request.body) / _BYTES_PER_TOKEN)
        limit = self._max_context_tokens
        if limit is not None and prompt_tokens > limit:
            return _refuse(
                400,
                f"This model's maximum context length is {limit} tokens. However, your messages"
                f" resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        try:
            reply = await self._next_reply(request)
        except Exception as error:  # a test's responder failing is an answer, not a crash
            return _refuse(500, str(error) or type(error).__name__, error_type="server_error")
        if isinstance(reply, Failure):
            extra: tuple[tuple[str, str], ...] = ()
            if reply.retry_after is not None:
                extra = (("Retry-After", _seconds(reply.retry_after)),)
            return _JsonAnswer(status=reply.status, body=reply.body(), extra=extra)
        cached_tokens = self._cached_tokens(request.body, prompt_tokens)
        self._served_bodies.append(request.body)
        self._answers += 1
        return _ChatAnswer(
            request=request,
            reply=reply,
            completion_id=f"chatcmpl-dsh{self._answers:012d}",
            model=model,
            created=int(time.time()),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )

    async def _next_reply(self, request: RecordedRequest) -> Completion | Failure | Stall:
        if self._queue:
            return self._queue.popleft()
        if self._responder is None:
            return Completion(text="ok")
        reply = self._responder(request)
        if inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, Completion | Failure | Stall):
            raise TypeError(f"the responder returned {reply!r}, not a Reply")
        return reply

    def _cached_tokens(self, body: bytes, prompt_tokens: int) -> int:
        shared = max((_common_prefix(body, earlier) for earlier in self._served_bodies), default=0)
        block = self._cache_block_tokens
        return min(prompt_tokens, shared // _BYTES_PER_TOKEN // block * block)

    # -- internals: writing answers -------------------------------------------------------------

    async def _send_json(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: Mapping[str, Any],
        *,
        keep_alive: bool,
        extra: tuple[tuple[str, str], ...] = (),
        cut: bool = False,
    ) -> None:
        """Send a JSON answer (only the first half of the body when ``cut``)."""
        payload = _dumps(body)
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            *extra,
        ]
        if cut:
            payload = payload[: len(payload) // 2]
        writer.write(self._head(status, headers, keep_alive=keep_alive) + payload)
        await writer.drain()

    def _head(self, status: int, headers: list[tuple[str, str]], *, keep_alive: bool) -> bytes:
        lines = [f"HTTP/1.1 {status} {_phrase(status)}"]
        lines += [f"{name}: {value}" for name, value in headers]
        lines.append(f"x-request-id: req_dsh{len(self._requests):012d}")
        if not keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _stream_head(self, *, keep_alive: bool) -> bytes:
        headers = [
            ("Content-Type", "text/event-stream; charset=utf-8"),
            ("Transfer-Encoding", "chunked"),
            ("Cache-Control", "no-cache"),
        ]
        return self._head(200, headers, keep_alive=keep_alive)

    async def _stream(
        self,
        answer: _ChatAnswer,
        completion: Completion,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        keep_alive: bool,
    ) -> bool:
        """Stream ``completion``; False if the stream did not end (the client went away or
        the completion is cut), so the connection must close."""
        events = [*_stream_chunks(answer, completion), _DONE]
        if completion.cut_after is not None:
            events = events[: completion.cut_after]
        self._open_streams += 1
        try:
            writer.write(self._stream_head(keep_alive=keep_alive))
            for event in events:
                # Yield to the loop so the client's EOF is delivered before the next write;
                # a plain drain() does not yield while the socket buffer has room.
                await asyncio.sleep(0)
                if reader.at_eof():
                    self._count_disconnect()
                    return False
                writer.write(_http_chunk(event))
                await writer.drain()
            if completion.cut_after is not None:
                return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self._count_disconnect()
            return False
        finally:
            self._open_streams -= 1
        return True

    async def _stall(
        self, answer: _ChatAnswer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        assert isinstance(answer.reply, Stall)
        streamed = answer.request.stream
        if streamed:
            self._open_streams += 1
        try:
            if streamed:
                first = _chunk(answer, {"role": "assistant", "content": "", "refusal": None})
                text = _chunk(answer, {"content": answer.reply.text})
                writer.write(
                    self._stream_head(keep_alive=False) + _http_chunk(first) + _http_chunk(text)
                )
                await writer.drain()
            await _until_closed(reader)
        except ConnectionError:
            pass  # a reset is the client going away too
        finally:
            if streamed:
                self._open_streams -= 1
        self._count_disconnect()

    def _count_disconnect(self) -> None:
        self._disconnects += 1
        self._notify()


# -- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _JsonAnswer:
    status: int
    body: dict[str, Any]
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class _ChatAnswer:
    request: RecordedRequest
    reply: Completion | Stall
    completion_id: str
    model: str
    created: int
    prompt_tokens: int
    cached_tokens: int


_DONE = b"data: [DONE]\n\n"


def _refuse(
    status: int,
    message: str,
    *,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> _JsonAnswer:
    return _JsonAnswer(
        status=status, body=_error_body(message, error_type=error_type, param=param, code=code)
    )


def _error_body(
    message: str, *, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
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
    return _phrase(status)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _seconds(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0")


def _usage(answer: _ChatAnswer, completion: Completion) -> dict[str, Any] | None:
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
            "reasoning_tokens": len(completion.reasoning) // _BYTES_PER_TOKEN,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _whole_completion(answer: _ChatAnswer, completion: Completion) -> dict[str, Any]:
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


def _chunk(
    answer: _ChatAnswer, delta: dict[str, Any], *, finish_reason: str | None = None
) -> bytes:
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
    return b"data: " + _dumps(body) + b"\n\n"


def _stream_chunks(answer: _ChatAnswer, completion: Completion) -> list[bytes]:
    """The SSE events of a streamed completion, without the final ``[DONE]``."""
    deltas = list(_deltas(completion))
    first: dict[str, Any] = {"role": "assistant", "content": "", "refusal": None}
    if completion.reasoning:
        first = {"role": "assistant", "content": None, "reasoning_content": ""}
    elif not completion.text and completion.tool_calls:
        # OpenAI puts the role on the first tool-call chunk when there is no text.
        first = {"role": "assistant", "content": None, "refusal": None} | deltas.pop(0)
    events = [_chunk(answer, first)]
    events += [_chunk(answer, delta) for delta in deltas]
    events.append(_chunk(answer, {}, finish_reason=completion.reason))
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
        events.append(b"data: " + _dumps(final) + b"\n\n")
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


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _parse_json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:  # UnicodeDecodeError is one too
        return None


def _common_prefix(a: bytes, b: bytes) -> int:
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


# -- reading requests ---------------------------------------------------------------------------


class _BadRequest(Exception):
    """The bytes are not an HTTP/1.1 request this server can read; answered 400, then closed."""


@dataclass(frozen=True, kw_only=True)
class _Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    try:
        line = await reader.readline()
    except ValueError as long:  # the line went past the reader's limit
        raise _BadRequest("a request line or header is too long") from long
    if not line.endswith(b"\n"):
        raise asyncio.IncompleteReadError(line, None)
    return line


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The request line and headers, or None at a clean end of the connection."""
    try:
        first = await reader.readline()
    except ValueError as long:
        raise _BadRequest("the request line is too long") from long
    if not first:
        return None
    if not first.endswith(b"\n"):
        raise asyncio.IncompleteReadError(first, None)
    parts = first.decode("latin-1").strip().split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(f"not an HTTP/1.x request line: {first[:100]!r}")
    method, target, version = parts
    headers: dict[str, str] = {}
    while (line := await _read_line(reader)) not in (b"\r\n", b"\n"):
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon or not name.strip():
            raise _BadRequest(f"a malformed header line: {line[:100]!r}")
        key, value = name.strip().lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return _Head(method=method, target=target, version=version, headers=headers)


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.split(",")[-1].strip().lower() != "chunked":
            raise _BadRequest(f"an unsupported Transfer-Encoding: {coding}")
        return await _read_chunked(reader)
    length = headers.get("content-length")
    if length is None:
        return b""
    if not length.isdigit() or int(length) > _MAX_BODY:
        raise _BadRequest(f"a bad Content-Length: {length!r}")
    return await reader.readexactly(int(length))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = (await _read_line(reader)).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise _BadRequest(f"a bad chunk size: {size_text[:20]!r}") from None
        if size < 0 or total + size > _MAX_BODY:
            raise _BadRequest(f"a bad chunk size: {size_text[:20]!r}")
        if size == 0:
            break
        parts.append(await reader.readexactly(size))
        total += size
        if await reader.readexactly(2) != b"\r\n":
            raise _BadRequest("a chunk not followed by CRLF")
    while await _read_line(reader) not in (b"\r\n", b"\n"):
        pass  # trailers: nothing here uses them
    return b"".join(parts)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Wait, without polling, until the peer closes its side; whatever it sends is dropped."""
    while await reader.read(_READ_SIZE):
        pass
