"""A small HTTP/1.1 client for the streamed POSTs of one provider to one plain ``http://``
origin: the local model servers (vLLM, llama.cpp's server, Ollama) where one node runs
thousands of streams at once.

httpx walks every piece of a response through httpcore, h11 and anyio (a cancel scope, a
timeout and an async-library lookup per read): at 1,000 streams that was most of a node's CPU,
about 40 us a streamed token, where this client spends about 10 (ADR 0047, section 11). It does
only what those calls need: keep-alive connections, at most ``max_connections`` at once (a call
past them waits for one); ``Content-Length``, chunked and read-to-close bodies; gzip and deflate;
one head of at most :data:`MAX_HEAD` bytes; bodies handed out in pieces of at most
:data:`MAX_PIECE` bytes whatever size a server declares (its caller bounds the whole).

Failures are httpx's own exception types, so its caller has one error path for both clients:
``ConnectError``/``ConnectTimeout`` (no connection), ``PoolTimeout``, ``ReadTimeout`` (a
response silent for ``read_timeout`` while it is read, or a request not taken for as long),
``ReadError``/``WriteError`` (the connection failed), ``RemoteProtocolError`` (the server closed
the connection early or sent what is not HTTP/1.1). A connection that failed, or whose response
was not read to its end, is closed, never reused. The caller's ``trace`` (httpx's ``trace``
extension) hears ``connection.connect_tcp.started`` when a connection is opened and
``http11.send_request_headers.started`` when a request is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

MAX_HEAD = 64 * 1024
"""Bytes of a response's status line and headers together, at most."""
MAX_PIECE = 64 * 1024
"""Bytes of a body handed out at once, at most."""

MAX_INTERIM = 8
"""Interim (1xx) answers before a request's real one, at most."""

Trace = Callable[[str, Mapping[str, Any]], Awaitable[None]]

_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_LENGTH = re.compile(r"[0-9]{1,18}")


def _check_header(name: str, value: str) -> None:
    if not name or any(c in name for c in ":\r\n") or any(c in value for c in "\r\n"):
        raise ValueError(f"header {name!r} cannot be sent in HTTP/1.1")


class Http1Pool:
    """Keep-alive connections to the origin of ``base_url`` (``http://`` only; its path is the
    prefix of every call's). ``headers`` go with every request. The caller closes it."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        headers: Mapping[str, str],
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname or "@" in url.netloc:
            raise ValueError(f"{base_url!r} is not an http:// URL without credentials")
        self._host = url.hostname
        self._port = url.port or 80
        self._prefix = url.path.rstrip("/") + "/"
        for name, value in headers.items():
            _check_header(name, value)
        fixed = {"Host": url.netloc, "User-Agent": "dsh-mesh", **headers}
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._closed = False

    async def aclose(self) -> None:
        """Close every idle connection; a call under way closes its own when it ends."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    @contextlib.asynccontextmanager
    async def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        trace: Trace | None = None,
    ) -> AsyncIterator[Http1Response]:
        """POST ``body`` to ``path`` (under the base URL's path); the response once its head
        arrived. Its connection goes back to the pool on the way out if the response was read
        to its end and the server keeps it alive, else it is closed."""
        if self._closed:
            raise httpx.ConnectError("the connection pool is closed")
        for name, value in headers.items():
            _check_header(name, value)
        head = (
            f"POST {self._prefix}{path} HTTP/1.1\r\n{self._fixed}"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            + f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        if self._slots.locked():
            try:
                async with asyncio.timeout(self._read_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection came free in time") from None
        else:
            await self._slots.acquire()
        connection: _Connection | None = None
        try:
            connection = self._reused()
            if connection is None:
                if trace is not None:
                    await trace("connection.connect_tcp.started", {})
                connection = await _Connection.connect(
                    self._host, self._port, self._connect_timeout, self._read_timeout
                )
            if trace is not None:
                await trace("http11.send_request_headers.started", {})
            response = await connection.exchange(head, body)
            try:
                yield response
            finally:
                # Read to its end, whatever its caller made of it (a refusal raises): reused.
                if response.reusable and connection.usable and not self._closed:
                    connection.rest()
                    self._idle.append(connection)
                    connection = None
        finally:
            if connection is not None:
                connection.close()
            self._slots.release()

    def _reused(self) -> _Connection | None:
        """The most recently used idle connection the server has not closed (the warmest)."""
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
            connection.close()
        return None


class _Connection:
    """One TCP connection and its one exchange at a time. Reads and writes are watched by one
    timer: a wait for the server longer than ``read_timeout`` aborts the connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_timeout: float
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self._waiting = False
        self._since = 0.0
        self._timed_out = False
        self._answered = False
        self._watch: asyncio.TimerHandle | None = None

    @classmethod
    async def connect(
        cls, host: str, port: int, connect_timeout: float, read_timeout: float
    ) -> _Connection:
        try:
            async with asyncio.timeout(connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} in time") from None
        except OSError as failure:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {failure}") from None
        return cls(reader, writer, read_timeout)

    @property
    def usable(self) -> bool:
        """Open, and nothing unasked for waits in it: bytes past a response's end (a server's
        idle-time 408, a body longer than its framing) would be read as the next answer."""
        return (
            not self._writer.transport.is_closing()
            and not self._reader.at_eof()
            and not self._reader._buffer  # type: ignore[attr-defined]  # what it read, unasked
        )

    def rest(self) -> None:
        """Idle in the pool: nothing to watch until the next exchange."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._writer.transport.abort()

    async def exchange(self, head: bytes, body: bytes) -> Http1Response:
        """Send one request; its response once the head arrived."""
        if self._watch is None:
            self._watch = self._loop.call_later(self._timeout, self._check)
        self._answered = False
        self._wait()
        try:
            self._writer.write(head + body)
            await self._writer.drain()
        except OSError as failure:
            raise self._failed(failure, httpx.WriteError) from None
        finally:
            self._waiting = False
        for _ in range(MAX_INTERIM + 1):
            status, reason, version, headers = await self._head()
            if status == 101:
                raise httpx.RemoteProtocolError("the server switched protocols unasked")
            if not 100 <= status < 200:
                return Http1Response(self, status, reason, version, headers)
            # An interim answer (100 Continue, 103 Early Hints) is followed by the real one.
        raise httpx.RemoteProtocolError(f"more than {MAX_INTERIM} interim answers")

    # -- reads, each watched ------------------------------------------------------------------

    def _wait(self) -> None:
        self._waiting = True
        self._since = self._loop.time()

    def _check(self) -> None:
        """The watch timer: abort a wait older than the timeout, else look again later."""
        due = self._since + self._timeout
        if self._waiting and self._loop.time() >= due:
            self._timed_out = True
            self._watch = None
            self._writer.transport.abort()
            return
        at = due if self._waiting else self._loop.time() + self._timeout
        self._watch = self._loop.call_at(at, self._check)

    def _failed(
        self, failure: BaseException, kind: type[httpx.TransportError]
    ) -> httpx.TransportError:
        if self._timed_out:
            return self._silent()
        if isinstance(failure, asyncio.IncompleteReadError):
            if not self._answered:
                # How a kept-alive connection the server had closed fails: nothing answered.
                return httpx.RemoteProtocolError(
                    "the server disconnected without sending a response"
                )
            return httpx.RemoteProtocolError("the server closed the connection mid-response")
        if isinstance(failure, asyncio.LimitOverrunError):
            return httpx.RemoteProtocolError(f"the server sent a line over {MAX_HEAD} bytes")
        return kind(f"{type(failure).__name__}: {failure}")

    def _silent(self) -> httpx.ReadTimeout:
        return httpx.ReadTimeout(f"the server was silent for {self._timeout:g} s")

    async def line(self) -> bytes:
        """One line without its CRLF (at most :data:`MAX_HEAD` bytes)."""
        self._wait()
        try:
            line = await self._reader.readuntil(b"\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as failure:
            raise self._failed(failure, httpx.ReadError) from None
        finally:
            self._waiting = False
        return line[:-2]

    async def exactly(self, size: int) -> bytes:
        self._wait()
        try:
            return await self._reader.readexactly(size)
        except (OSError, asyncio.IncompleteReadError) as failure:
            raise self._failed(failure, httpx.ReadError) from None
        finally:
            self._waiting = False

    async def some(self, most: int) -> bytes:
        """Up to ``most`` bytes, b"" at the end of the connection."""
        self._wait()
        try:
            piece = await self._reader.read(most)
        except OSError as failure:
            raise self._failed(failure, httpx.ReadError) from None
        finally:
            self._waiting = False
        if not piece and self._timed_out:  # the watch aborted it: not the body's end
            raise self._silent()
        return piece

    async def _head(self) -> tuple[int, str, str, dict[str, str]]:
        first = await self.line()
        self._answered = True
        version, _, rest = first.partition(b" ")
        code, _, reason = rest.partition(b" ")
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 status line: {first[:80]!r}")
        headers: dict[str, str] = {}
        size = len(first)
        while line := await self.line():
            size += len(line) + 2
            if size > MAX_HEAD:
                raise httpx.RemoteProtocolError(f"a response head over {MAX_HEAD} bytes")
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise httpx.RemoteProtocolError(f"not a header line: {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        return int(code), reason.decode("latin-1"), version.decode(), headers


class Http1Response:
    """A response whose head arrived: ``status_code``, ``reason_phrase`` and ``headers``
    (names in lower case, repeated ones joined by ", "); :meth:`aiter_bytes` reads its body,
    once."""

    def __init__(
        self,
        connection: _Connection,
        status: int,
        reason: str,
        version: str,
        headers: dict[str, str],
    ) -> None:
        self.status_code = status
        self.reason_phrase = reason
        self.headers = headers
        self._connection = connection
        self._read = False
        self._ended = False
        tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
        self._keep_alive = (
            "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
        )

    @property
    def reusable(self) -> bool:
        """Whether its connection may carry another request: the body was read to its end,
        framed (not ended by the connection's close), and the server keeps it alive."""
        return self._ended and self._keep_alive

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes, decoded from gzip or deflate, in pieces."""
        if self._read:
            raise RuntimeError("a response's body is read once")
        self._read = True
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            async for piece in self._raw():
                yield piece
            return
        if encoding not in ("gzip", "deflate", "x-gzip"):
            raise httpx.RemoteProtocolError(f"the server sent a body in {encoding!r}")
        # gzip or zlib, told by its header; a "deflate" body may also come without one (raw).
        decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)
        first = True
        try:
            async for piece in self._raw():
                if first and encoding == "deflate" and not _zlib_header(piece):
                    decoder = zlib.decompressobj(-zlib.MAX_WBITS)
                first = False
                if text := decoder.decompress(piece, MAX_PIECE):
                    yield text
                while decoder.unconsumed_tail:
                    yield decoder.decompress(decoder.unconsumed_tail, MAX_PIECE)
            if rest := decoder.flush():
                yield rest
        except zlib.error as failure:
            raise httpx.RemoteProtocolError(f"the server sent a body that is not {encoding}") from (
                failure
            )

    async def _raw(self) -> AsyncIterator[bytes]:
        status, headers, connection = self.status_code, self.headers, self._connection
        if status in (204, 304):
            self._ended = True
            return
        if "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower().rsplit(",", 1)[-1].strip() == "chunked":
                async for piece in self._chunked():
                    yield piece
                self._ended = True
                return
        elif "content-length" in headers:
            length = headers["content-length"]
            if not _LENGTH.fullmatch(length):
                raise httpx.RemoteProtocolError(f"a Content-Length of {length[:40]!r}")
            left = int(length)
            while left:
                piece = await connection.some(min(left, MAX_PIECE))
                if not piece:
                    raise httpx.RemoteProtocolError("the server closed the connection mid-body")
                left -= len(piece)
                yield piece
            self._ended = True
            return
        self._keep_alive = False  # read to the connection's close: it carries nothing more
        while piece := await connection.some(MAX_PIECE):
            yield piece

    async def _chunked(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            line = await connection.line()
            size_text = line.split(b";", 1)[0].strip()
            if not _CHUNK_SIZE.fullmatch(size_text):
                raise httpx.RemoteProtocolError(f"not a chunk size: {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                trailer = 0
                while extra := await connection.line():  # trailers, skipped
                    trailer += len(extra) + 2
                    if trailer > MAX_HEAD:
                        raise httpx.RemoteProtocolError(f"trailers over {MAX_HEAD} bytes")
                return
            if size <= MAX_PIECE:
                data = await connection.exactly(size + 2)
                if data[-2:] != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk longer than its size")
                yield data[:-2]
                continue
            while size:
                piece = await connection.exactly(min(size, MAX_PIECE))
                size -= len(piece)
                yield piece
            if await connection.exactly(2) != b"\r\n":
                raise httpx.RemoteProtocolError("a chunk longer than its size")


def _zlib_header(data: bytes) -> bool:
    """Whether ``data`` begins with a zlib header (RFC 1950: deflate, and a check sum)."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
