"""A provider for OpenAI-compatible chat-completions endpoints (OpenAI, vLLM, Ollama, llama.cpp
server, DeepSeek and the many hosted APIs that speak the protocol).

One :class:`OpenAIProvider` owns one connection pool to one endpoint: for a plain ``http://``
endpoint no proxy stands in front of (a local model server), this package's own HTTP/1.1 client
(:class:`~dsh_mesh.models._http1.Http1Pool`, a third of httpx's CPU a streamed token); else
``httpx`` (HTTP/2 where the server offers it over TLS, HTTP/1.1 keep-alive otherwise). Every
call is streamed and consumed as it arrives. A call the endpoint refuses as overloaded (429)
or fails (5xx, a dropped connection) before anything streamed is retried under the endpoint's
:class:`RetryPolicy`; one that failed on a reused keep-alive connection before its response
began (the server had closed it) is sent again at once, without spending an attempt; a prompt
past the model's context raises :class:`~dsh_mesh.core.ContextOverflow`; anything else raises
:class:`ProviderError` with the endpoint's own message. Cancelling the consuming task closes
the HTTP request.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import email.utils
import logging
import os
import random
import re
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import httpx
from httpx._utils import URLPattern, get_environment_proxies  # how httpx picks a proxy

from dsh_mesh.core import MAX_JSON_DEPTH, ContextOverflow, InvalidArgument, parse_bounded
from dsh_mesh.models._http1 import Http1Pool
from dsh_mesh.models._openai_wire import (
    RESERVED_FIELDS,
    ErrorReport,
    StreamAssembler,
    StreamError,
    error_of,
    request_body,
)
from dsh_mesh.models._protocol import ModelEvent, ModelRequest, ProviderError
from dsh_mesh.models._retry import RetryPolicy

_log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
POOL_SHARD = 8
"""Connections of one httpx client at most: a bigger pool is several clients (see
:meth:`OpenAIEndpoint.http_clients`)."""


_JSON = {"Content-Type": "application/json"}


class _Response(Protocol):
    """What a call reads of a response, from httpx's client or this package's own."""

    @property
    def status_code(self) -> int: ...
    @property
    def reason_phrase(self) -> str: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    def aiter_bytes(self) -> AsyncIterator[bytes]: ...


def _direct_http(base_url: str) -> bool:
    """Whether calls to ``base_url`` go through :class:`Http1Pool`: a plain ``http://``
    endpoint without credentials in its URL, that no proxy of the environment stands in front
    of, decided as httpx decides it (``HTTP_PROXY``, ``ALL_PROXY``, less ``NO_PROXY``).
    Anything else (TLS, HTTP/2, a proxy, Basic auth) is httpx's."""
    url = httpx.URL(base_url)
    if url.scheme != "http" or not url.host or url.userinfo:
        return False
    patterns = sorted((URLPattern(key), proxy) for key, proxy in get_environment_proxies().items())
    for pattern, proxy in patterns:
        if pattern.matches(url):
            return proxy is None
    return True


def is_retried(status: int) -> bool:
    """Whether a status says "not now" rather than "never": a timeout, a conflict, a rate
    limit, or a server failure (any 5xx but 501, which says the server cannot do it at all)."""
    return status in (408, 409, 425, 429) or (status >= 500 and status != 501)


@dataclass(frozen=True, kw_only=True)
class OpenAIEndpoint:
    """Where and how to reach one OpenAI-compatible endpoint.

    ``base_url`` ends where ``/chat/completions`` is appended (``http://127.0.0.1:11434/v1``
    for Ollama, ``http://host:8000/v1`` for vLLM). Without ``api_key`` no ``Authorization``
    header is sent (local servers need none). ``body`` holds extra request fields sent with
    every call (``temperature``, ``seed``...), before the tools and messages.
    """

    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    connect_timeout: timedelta = timedelta(seconds=10)
    read_timeout: timedelta = timedelta(seconds=300)
    """The longest silence between two pieces of a response (a long prefill is silent)."""
    max_connections: int = 32
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    body: Mapping[str, Any] = field(default_factory=dict)
    max_tokens_field: str = "max_tokens"
    """The body field a preset's ``max_output_tokens`` is sent as: ``max_tokens`` (vLLM,
    Ollama, DeepSeek, most servers) or ``max_completion_tokens`` (OpenAI's reasoning models,
    which refuse ``max_tokens``)."""
    structured_outputs: bool = True
    """Whether a step of a session that names an output schema asks the server for it
    (``response_format`` of type ``json_schema``, ADR 0052). Turn it off for a server that
    refuses that field (some refuse it beside tools): the answer is checked either way."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {self.base_url!r} must be an http:// or https:// URL")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if self.connect_timeout <= timedelta(0) or self.read_timeout <= timedelta(0):
            raise ValueError("timeouts must be positive")
        if self.max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError("max_tokens_field must be max_tokens or max_completion_tokens")
        reserved = sorted(RESERVED_FIELDS.intersection(self.body))
        if reserved:
            raise ValueError(f"body fields {reserved} are set by the provider itself")

    def http_clients(
        self, transport: httpx.AsyncBaseTransport | None = None
    ) -> list[tuple[int, httpx.AsyncClient]]:
        """The pool of this endpoint as clients of at most :data:`POOL_SHARD` connections each
        (with their sizes), ``max_connections`` in all: httpcore's pool looks at every
        connection it holds for each request it places, so one pool of thousands of
        connections spends more on that than on the streams (ADR 0047). The caller closes
        them."""
        sizes = [POOL_SHARD] * (self.max_connections // POOL_SHARD)
        if self.max_connections % POOL_SHARD:
            sizes.append(self.max_connections % POOL_SHARD)
        tls = httpx.create_ssl_context()  # one for every client: each costs a CA bundle
        return [(n, self.http_client(transport, max_connections=n, tls=tls)) for n in sizes]

    def http_client(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_connections: int | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> httpx.AsyncClient:
        """A pooled client for this endpoint: its base URL, key, timeouts and pool size
        (``max_connections`` unless given), HTTP/2 where the server offers it (over the
        network; ``transport`` replaces that, for tests), verifying servers with ``tls``
        (default: httpx's own context). The caller closes it."""
        pool = self.max_connections if max_connections is None else max_connections
        return httpx.AsyncClient(
            base_url=self.base_url.rstrip("/") + "/",
            headers=self._headers(),
            http2=transport is None,
            transport=transport,
            verify=True if tls is None else tls,
            timeout=httpx.Timeout(
                self.read_timeout.total_seconds(),
                connect=self.connect_timeout.total_seconds(),
            ),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
        )

    def http1_pool(self) -> Http1Pool:
        """This package's own HTTP/1.1 pool for this (plain ``http://``) endpoint: its base
        URL, key, timeouts and ``max_connections``. The caller closes it."""
        return Http1Pool(
            self.base_url,
            max_connections=self.max_connections,
            connect_timeout=self.connect_timeout.total_seconds(),
            read_timeout=self.read_timeout.total_seconds(),
            headers=self._headers(),
        )

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def from_environment(environ: Mapping[str, str] | None = None) -> OpenAIEndpoint:
        """The endpoint the standard ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` variables name
        (OpenAI's own API when the URL is unset)."""
        env = os.environ if environ is None else environ
        return OpenAIEndpoint(
            base_url=env.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL,
            api_key=env.get("OPENAI_API_KEY") or None,
        )


class _Retryable(Exception):
    """A failure another attempt may not meet. ``stale``: the request went out on a connection
    the pool reused and failed before its response's head arrived, which is how a connection
    the server had already closed fails; it says nothing of the endpoint's health."""

    def __init__(
        self, message: str, *, status: int | None, retry_after: float | None, stale: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.stale = stale


_CONNECTING = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Failures to get a connection at all: never of a reused one."""


class _ConnectionTrace:
    """What httpcore's ``trace`` extension tells of one attempt: whether its request headers
    were sent on a connection it did not open itself (one the pool reused). A transport that
    reports nothing (a test's mock) reads as "not reused"."""

    def __init__(self) -> None:
        self._opened = False
        self._sent = False

    async def __call__(self, event: str, info: Mapping[str, Any]) -> None:
        if event.startswith(("connection.connect_tcp.", "connection.connect_unix.")):
            self._opened = True
        elif event.endswith(".send_request_headers.started"):
            self._sent = True

    @property
    def reused(self) -> bool:
        return self._sent and not self._opened


class OpenAIProvider:
    """Streams chat completions from one endpoint. ``request.model`` is the endpoint's own
    model name (a :class:`ModelRouter` strips the ``<endpoint>:`` prefix of a model spec).

    Safe for any number of concurrent calls on one event loop; :meth:`aclose` closes the pool
    (idempotent). ``transport`` replaces the network for tests of the provider alone.
    """

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        *,
        name: str = "openai",
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self._rng = rng or random.Random()
        self._http1: Http1Pool | None = None
        self._clients: list[httpx.AsyncClient] = []
        self._free: list[int] = []
        """Connections of each httpx client not taken by a call under way (negative: calls
        wait)."""
        if transport is None and _direct_http(endpoint.base_url):
            self._http1 = endpoint.http1_pool()
        else:
            pool = endpoint.http_clients(transport)
            self._clients = [client for _, client in pool]
            self._free = [size for size, _ in pool]

    async def aclose(self) -> None:
        """Close the connection pool; calls after this fail."""
        if self._http1 is not None:
            await self._http1.aclose()
        for client in self._clients:
            await client.aclose()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        body = request_body(
            request,
            model=request.model,
            extra=self.endpoint.body,
            max_output_tokens=request.max_output_tokens,
            max_tokens_field=self.endpoint.max_tokens_field,
            output_schema=request.output_schema if self.endpoint.structured_outputs else "",
        )
        policy = self.endpoint.retry
        started = time.monotonic()
        attempt = 1
        resent = 0
        while True:
            streamed = False
            try:
                # Closed on the way out, whatever ends the call: its response goes with it.
                async with contextlib.aclosing(self._attempt(body)) as events:
                    async for event in events:
                        streamed = True
                        yield event
                return
            except _Retryable as failure:
                if streamed:
                    raise ProviderError(
                        f"{self.name}: the response broke off: {failure}",
                        status=failure.status,
                        attempts=attempt,
                    ) from failure
                if failure.stale and resent < self.endpoint.max_connections:
                    # The server had closed the kept-alive connection (llama.cpp's does,
                    # right after a streamed response): nothing was wrong with the call,
                    # so it goes again at once, and the pool opens a fresh connection once
                    # its stale ones are spent (at most one per pooled connection).
                    resent += 1
                    _log.info("%s: %s; sent again on another connection", self.name, failure)
                    continue
                wait = policy.backoff(attempt, retry_after=failure.retry_after, rng=self._rng)
                spent = time.monotonic() - started
                if attempt == policy.max_attempts or spent + wait > policy.budget.total_seconds():
                    raise ProviderError(
                        f"{self.name}: {failure} (gave up after {attempt} attempts in"
                        f" {spent:.1f} s)",
                        status=failure.status,
                        attempts=attempt,
                    ) from failure
                _log.warning("%s: %s; retry %d in %.2f s", self.name, failure, attempt, wait)
                await asyncio.sleep(wait)
                attempt += 1

    @contextlib.asynccontextmanager
    async def _exchange(self, body: bytes, trace: _ConnectionTrace) -> AsyncIterator[_Response]:
        """POST ``body`` to the endpoint's ``chat/completions``: the response once its head
        arrived, through this client's own HTTP/1.1 pool or httpx."""
        if self._http1 is not None:
            async with self._http1.post("chat/completions", body, _JSON, trace=trace) as answer:
                yield answer
            return
        # The client with the most free connections (the first of those: a light load reuses
        # the same warm connections).
        shard = max(range(len(self._clients)), key=self._free.__getitem__)
        self._free[shard] -= 1
        try:
            async with self._clients[shard].stream(
                "POST", "chat/completions", content=body, headers=_JSON, extensions={"trace": trace}
            ) as response:
                yield response
        finally:
            self._free[shard] += 1

    async def _attempt(self, body: bytes) -> AsyncGenerator[ModelEvent, None]:
        trace = _ConnectionTrace()
        answered = False
        try:
            async with self._exchange(body, trace) as response:
                answered = True
                if response.status_code != 200:
                    raise self._refusal(response, await _body(response) or b"")
                assembler = StreamAssembler()
                if response.headers.get("content-type", "").startswith("application/json"):
                    # A server that ignores "stream": the whole completion at once.
                    whole = await _body(response)
                    if whole is None:
                        raise _too_large("a completion")
                    payloads: AsyncIterator[Any] = _whole(whole)
                else:
                    payloads = _server_sent_data(response)
                async for payload in payloads:
                    for event in assembler.feed(payload):
                        yield event
                for event in assembler.finish():
                    yield event
        except StreamError as error:
            raise self._failure(error.report, status=None) from error
        except httpx.TransportError as error:
            raise _Retryable(
                f"{type(error).__name__} talking to {self.endpoint.base_url}: {error}",
                status=None,
                retry_after=None,
                stale=trace.reused and not answered and not isinstance(error, _CONNECTING),
            ) from error

    def _refusal(self, response: _Response, raw: bytes) -> Exception:
        status = response.status_code
        report = error_of(raw, fallback=f"HTTP {status} {response.reason_phrase}")
        if is_retried(status) and not report.context_length:
            return _Retryable(
                f"HTTP {status}: {report.message}",
                status=status,
                retry_after=_retry_after(response.headers.get("retry-after")),
            )
        return self._failure(report, status=status)

    def _failure(self, report: ErrorReport, *, status: int | None) -> Exception:
        if report.context_length:
            return ContextOverflow(f"{self.name}: the context is full: {report.message}")
        shown = f"HTTP {status}: " if status is not None else ""
        return ProviderError(f"{self.name}: {shown}{report.message}", status=status)


async def _server_sent_data(response: _Response) -> AsyncIterator[Any]:
    """The JSON payload of each ``data:`` event of a server-sent-event stream, up to
    ``[DONE]``. Lines of one event are joined; comments and other fields are skipped. The body
    is read to its end even after ``[DONE]``: a connection whose response was not read whole
    cannot go back to the pool."""
    lines: list[str] = []
    size = 0
    done = False
    async for line in _lines(response):
        if done:
            continue
        if line:
            if line.startswith("data:"):
                lines.append(line[5:].removeprefix(" "))
                size += len(lines[-1]) + 1
                if size > _MAX_CHUNK_BYTES:
                    raise _too_large("an event")
            continue
        if not lines:
            continue
        data, lines, size = "\n".join(lines), [], 0
        if data.strip() == "[DONE]":
            done = True
            continue
        yield _parse(data)
    if lines and not done and (data := "\n".join(lines)).strip() != "[DONE]":
        yield _parse(data)


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


async def _lines(response: _Response) -> AsyncIterator[str]:
    """The body's lines, split at CRLF, LF or CR as server-sent events are (a CR at the end
    of a read waits for the next: it may be half a CRLF). A line longer than
    :data:`_MAX_CHUNK_BYTES` is refused as it arrives, never held whole: a server that sends
    no line break must not fill the node's memory."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    async for raw in response.aiter_bytes():
        text = pending + decoder.decode(raw)
        held = text.endswith("\r")
        *whole, pending = _LINE_BREAK.split(text[:-1] if held else text)
        for line in whole:
            yield line
        if held:
            pending += "\r"
        if len(pending) > _MAX_CHUNK_BYTES:
            raise _too_large("a line")
    *whole, last = _LINE_BREAK.split(pending + decoder.decode(b"", final=True))
    for line in whole:
        yield line
    if last:
        yield last


async def _body(response: _Response) -> bytes | None:
    """The whole body, or None once it passed :data:`_MAX_CHUNK_BYTES` (nothing more is
    read: the connection is closed, not pooled)."""
    parts: list[bytes] = []
    size = 0
    async for raw in response.aiter_bytes():
        size += len(raw)
        if size > _MAX_CHUNK_BYTES:
            return None
        parts.append(raw)
    return b"".join(parts)


def _too_large(what: str) -> StreamError:
    return StreamError(
        ErrorReport(
            message=f"the endpoint sent {what} larger than {_MAX_CHUNK_BYTES >> 20} MiB, "
            "which is more than any completion needs; nothing of it was kept"
        )
    )


async def _whole(raw: bytes) -> AsyncIterator[Any]:
    yield _parse(raw.decode(errors="replace"))


_MAX_CHUNK_DEPTH = MAX_JSON_DEPTH + 8
"""How deeply one chunk may nest: its envelope, and arguments some servers send as an object."""
_MAX_CHUNK_BYTES = 16 * 1024 * 1024
"""The largest chunk (or whole completion of a server that ignores ``stream``) read."""


def _parse(data: str) -> Any:
    try:
        return parse_bounded(data, max_depth=_MAX_CHUNK_DEPTH, max_bytes=_MAX_CHUNK_BYTES)
    except InvalidArgument as bad:
        raise StreamError(
            ErrorReport(
                message=f"the endpoint sent a chunk that is not JSON it takes: {bad.detail}"
            )
        ) from bad


def _retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (a number or an HTTP date), if any."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
