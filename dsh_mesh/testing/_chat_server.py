"""A local HTTP server that speaks the OpenAI chat-completions protocol, for tests.

:class:`ChatCompletionsServer` listens on ``127.0.0.1`` and a free port and answers
``POST /v1/chat/completions`` the way OpenAI, vLLM and DeepSeek do, from replies a test scripts:
a :class:`Completion` (text and tool calls, streamed as server-sent events or returned whole), a
:class:`Failure` (an HTTP error with OpenAI's error body and an optional ``Retry-After``) or a
:class:`Stall` (a stream that starts and then goes silent until the client gives up). Every
request is kept byte-exact as a :class:`RecordedRequest`, recorded before it is answered.

It is plain asyncio streams, HTTP/1.1 with keep-alive: request bodies by ``Content-Length`` or
``Transfer-Encoding: chunked``, streamed responses chunked, one SSE event per HTTP chunk.

Token accounting is explained in the docstring of :mod:`dsh_mesh.testing._chat_replies`, with
the replies and the payloads; HTTP framing is in :mod:`dsh_mesh.testing._http1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from dsh_mesh.models._tool_order import Turn, tool_call_order_error
from dsh_mesh.testing._chat_replies import (
    BYTES_PER_TOKEN,
    DONE,
    ChatAnswer,
    Completion,
    Failure,
    RecordedRequest,
    Reply,
    Responder,
    Stall,
    chunk,
    common_prefix,
    dumps,
    error_body,
    parse_json,
    phrase,
    stream_chunks,
    whole_completion,
)
from dsh_mesh.testing._http1 import (
    HEAD_LINE_LIMIT,
    BadRequest,
    http_chunk,
    read_body,
    read_head,
    until_closed,
)

# The package imports the scripted replies from here as well as the server.
_LOOPBACK = "127.0.0.1"
_DEFAULT_MODEL = "test-model"
_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MODEL_PATHS = frozenset({"/v1/models", "/models"})


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
    With ``strict_tool_calls`` it also refuses, as OpenAI does (400, its message), a
    conversation in which an assistant message's tool calls are not each followed by their one
    ``tool`` message before anything else (:func:`~dsh_mesh.models.tool_call_order_error`).
    ``GET /v1/models`` lists the models requested so far (or ``"test-model"``); anything else
    is a 404 with an error body. Token accounting is in the ``_chat_replies``
    module docstring.

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
        strict_tool_calls: bool = False,
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
        self._strict_tool_calls = strict_tool_calls
        self._queue: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._served_bodies: set[bytes] = set()
        """The distinct bodies served: the simulated prefix cache compares with each once."""
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
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on its connections only then, and without
        # it each streamed answer on a kept-alive connection waits for a delayed ACK (40 ms).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
                self._accept, sock=sock, limit=HEAD_LINE_LIMIT
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
            head = await read_head(reader)
            if head is None:
                return False
            if head.headers.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await read_body(reader, head.headers)
        except BadRequest as bad:
            body_json = error_body(str(bad), error_type="invalid_request_error")
            await self._send_json(writer, 400, body_json, keep_alive=False)
            return False
        target = urlsplit(head.target)
        request = RecordedRequest(
            method=head.method,
            path=target.path or "/",
            query=target.query,
            headers=MappingProxyType(head.headers),
            body=body,
            json=parse_json(body),
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
            whole_completion(answer, answer.reply),
            keep_alive=head.keep_alive,
            cut=cut,
        )
        return head.keep_alive and not cut

    # -- internals: what to answer --------------------------------------------------------------

    async def _route(self, request: RecordedRequest) -> _JsonAnswer | ChatAnswer:
        if self._api_key is not None and not self._authorized(request):
            return _JsonAnswer(
                status=401,
                body=error_body(
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
            body=error_body(
                f"Invalid URL ({request.method} {request.path})",
                error_type="invalid_request_error",
            ),
        )

    def _authorized(self, request: RecordedRequest) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and token.strip() == self._api_key

    async def _chat(self, request: RecordedRequest) -> _JsonAnswer | ChatAnswer:
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
        if self._strict_tool_calls:
            refusal = tool_call_order_error(_turns(payload["messages"]))
            if refusal is not None:
                return _refuse(400, refusal, param="messages")
        self._models.setdefault(model)
        prompt_tokens = math.ceil(len(request.body) / BYTES_PER_TOKEN)
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
        self._served_bodies.add(request.body)
        self._answers += 1
        return ChatAnswer(
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
        # A body served before shares all of itself; else the longest prefix with any other.
        if body in self._served_bodies:
            shared = len(body)
        else:
            shared = max(
                (common_prefix(body, earlier) for earlier in self._served_bodies), default=0
            )
        block = self._cache_block_tokens
        return min(prompt_tokens, shared // BYTES_PER_TOKEN // block * block)

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
        payload = dumps(body)
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
        lines = [f"HTTP/1.1 {status} {phrase(status)}"]
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
        answer: ChatAnswer,
        completion: Completion,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        keep_alive: bool,
    ) -> bool:
        """Stream ``completion``; False if the stream did not end (the client went away or
        the completion is cut), so the connection must close."""
        events = [*stream_chunks(answer, completion), DONE]
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
                writer.write(http_chunk(event))
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
        self, answer: ChatAnswer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        assert isinstance(answer.reply, Stall)
        streamed = answer.request.stream
        if streamed:
            self._open_streams += 1
        try:
            if streamed:
                first = chunk(answer, {"role": "assistant", "content": "", "refusal": None})
                text = chunk(answer, {"content": answer.reply.text})
                writer.write(
                    self._stream_head(keep_alive=False) + http_chunk(first) + http_chunk(text)
                )
                await writer.drain()
            await until_closed(reader)
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


def _refuse(
    status: int,
    message: str,
    *,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> _JsonAnswer:
    return _JsonAnswer(
        status=status, body=error_body(message, error_type=error_type, param=param, code=code)
    )


def _turns(messages: list[Any]) -> list[Turn]:
    """The tool-call rule's view of a request's ``messages`` (malformed items count as user
    messages: the rule judges only what it can read)."""
    turns: list[Turn] = []
    for message in messages:
        if not isinstance(message, dict):
            turns.append(("user", (), None))
            continue
        calls = message.get("tool_calls") or []
        ids = (
            tuple(str(call.get("id", "")) for call in calls if isinstance(call, dict))
            if isinstance(calls, list)
            else ()
        )
        answers = message.get("tool_call_id")
        turns.append((str(message.get("role", "")), ids, None if answers is None else str(answers)))
    return turns


def _seconds(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0")
