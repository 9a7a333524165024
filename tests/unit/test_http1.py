"""The provider's own HTTP/1.1 client (``models/_http1.py``, ADR 0047 section 11) against small
servers of this test's own on loopback, each answering with the bytes a case needs: bodies by
length, by chunks and to the connection's close, keep-alive reuse and its limits, and every way
a hostile or broken server can answer, each a typed httpx error and never a connection reused."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from dsh_mesh.models._http1 import MAX_HEAD, MAX_INTERIM, MAX_PIECE, Http1Pool
from dsh_mesh.models._openai import _direct_http

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Answers the ``n``th request of a connection (its head and body already read); whether the
connection stays open for another."""


@dataclass
class Server:
    answer: Answer
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                served += 1
                if not await self.answer(reader, writer, served):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(answer: Answer) -> AsyncIterator[Server]:
    server = Server(answer)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listening.close()


@contextlib.asynccontextmanager
async def pool(server: Server, **options: Any) -> AsyncIterator[Http1Pool]:
    settings: dict[str, Any] = {
        "max_connections": 4,
        "connect_timeout": 5.0,
        "read_timeout": 5.0,
        "headers": {"Accept": "text/event-stream"},
    }
    made = Http1Pool(f"http://127.0.0.1:{server.port}/v1", **(settings | options))
    try:
        yield made
    finally:
        await made.aclose()


async def call(pool: Http1Pool, **trace: Any) -> tuple[int, dict[str, str], bytes]:
    async with pool.post("chat/completions", b'{"a":1}', {"Content-Type": "x"}, **trace) as r:
        body = b"".join([piece async for piece in r.aiter_bytes()])
        return r.status_code, dict(r.headers), body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"


def sends(data: bytes, *, stay: bool = True) -> Answer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(data)
        await writer.drain()
        return stay

    return answer


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Twice: a\r\nx-twice: b\r\n\r\n"


async def test_a_chunked_answer_is_read_whole_and_its_connection_reused() -> None:
    events: list[str] = []

    async def trace(event: str, info: Any) -> None:
        events.append(event)

    answer = sends(CHUNKED_HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n"))
    async with serving(answer) as server, pool(server) as http:
        first = await call(http, trace=trace)
        second = await call(http, trace=trace)
    assert first == second == (200, {"transfer-encoding": "chunked", "x-twice": "a, b"}, first[2])
    assert first[2] == b"data: 1\n\ndata: 2\n\n"
    assert server.connections == 1
    assert events == [
        "connection.connect_tcp.started",
        "http11.send_request_headers.started",
        "http11.send_request_headers.started",
    ]
    [head, _] = server.heads
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nContent-Length: 7\r\n" in head
    assert b"\r\nAccept: text/event-stream\r\n" in head and b"\r\nContent-Type: x\r\n" in head


async def test_a_body_by_length_and_a_gzipped_one_are_read_and_decoded() -> None:
    packed = gzip.compress(b'{"error": "busy"}')
    answers = [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
        % (len(packed), packed),
    ]

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(answers[n - 1])
        return True

    async with serving(answer) as server, pool(server) as http:
        assert (await call(http))[::2] == (503, b"busy!")
        assert (await call(http))[::2] == (200, b'{"error": "busy"}')
    assert server.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\n\r\nread to the close",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 17\r\n\r\nread to the close",
        b"HTTP/1.0 200 OK\r\nContent-Length: 17\r\n\r\nread to the close",
    ],
)
async def test_a_connection_the_server_does_not_keep_alive_is_not_reused(answer: bytes) -> None:
    async with serving(sends(answer, stay=False)) as server, pool(server) as http:
        assert (await call(http))[2] == b"read to the close"
        assert (await call(http))[2] == b"read to the close"
    assert server.connections == 2


async def test_an_interim_answer_is_skipped_for_the_real_one() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    answer = sends(interim + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with serving(answer) as server, pool(server) as http:
        assert (await call(http))[::2] == (200, b"ok")


async def test_a_body_not_read_to_its_end_closes_its_connection() -> None:
    async with (
        serving(sends(CHUNKED_HEAD + chunked(b"one", b"two"))) as server,
        pool(server) as http,
    ):
        async with http.post("p", b"", {}) as response:
            async for _ in response.aiter_bytes():
                break
        assert (await call(http))[2] == b"onetwo"
    assert server.connections == 2


async def test_a_chunk_declared_larger_than_a_piece_is_handed_out_in_pieces() -> None:
    big = b"x" * (MAX_PIECE * 2 + 10)
    async with (
        serving(sends(CHUNKED_HEAD + chunked(big))) as server,
        pool(server) as http,
        http.post("p", b"", {}) as response,
    ):
        pieces = [piece async for piece in response.aiter_bytes()]
    assert b"".join(pieces) == big
    assert max(map(len, pieces)) <= MAX_PIECE


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Big: y\r\n" * (MAX_HEAD // 10 + 1), "over"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        ("HTTP/1.1 200 OK\r\nContent-Length: 1\u00b2\r\n\r\n".encode("latin-1"), "Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", "Length"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched"),
        (b"HTTP/1.1 103 Early Hints\r\n\r\n" * (MAX_INTERIM + 1), "interim answers"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "longer than"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "mid-body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "mid-response"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx", "'br'"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "not"),
        (b"", "disconnected without sending a response"),
    ],
)
async def test_what_is_not_http_1_1_is_a_typed_error_and_its_connection_is_dropped(
    answer: bytes, words: str
) -> None:
    async with serving(sends(answer, stay=False)) as server, pool(server) as http:
        with pytest.raises(httpx.RemoteProtocolError, match=words):
            await call(http)
        assert http._idle == []


async def test_a_silent_server_is_a_read_timeout() -> None:
    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
        await asyncio.sleep(10)
        return False

    async with (
        serving(silent) as server,
        pool(server, read_timeout=0.3) as http,
        http.post("p", b"", {}) as response,
    ):
        pieces = response.aiter_bytes()
        assert await anext(pieces) == b"hello"
        with pytest.raises(httpx.ReadTimeout, match=r"silent for 0\.3 s"):
            await anext(pieces)


async def test_a_body_read_to_the_close_that_falls_silent_is_a_timeout_not_an_end() -> None:
    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await asyncio.sleep(10)
        return False

    async with serving(silent) as server, pool(server, read_timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await call(http)


async def test_bytes_past_a_responses_end_never_answer_the_next_request() -> None:
    extra = b"HTTP/1.1 404 Leftover\r\nContent-Length: 0\r\n\r\n"

    async def sloppy(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + extra)
        return True

    async with serving(sloppy) as server, pool(server) as http:
        assert (await call(http))[::2] == (200, b"ok")
        await asyncio.sleep(0.05)  # the bytes past its end have arrived
        assert (await call(http))[::2] == (200, b"ok")
    assert server.connections == 2


async def test_a_raw_deflate_body_is_decoded_as_httpx_decodes_it() -> None:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = packer.compress(b"raw deflate") + packer.flush()
    answer = b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%s"
    async with serving(sends(answer % (len(raw), raw))) as server, pool(server) as http:
        assert (await call(http))[2] == b"raw deflate"


async def test_an_idle_connection_holds_no_timer() -> None:
    answer = sends(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with serving(answer) as server, pool(server) as http:
        await call(http)
        [idle] = http._idle
        assert idle._watch is None


async def test_a_slow_reader_is_not_a_silent_server() -> None:
    """The timeout counts only while the client waits for the server."""
    pieces = []
    async with (
        serving(sends(CHUNKED_HEAD + chunked(b"a", b"b"))) as server,
        pool(server, read_timeout=0.2) as http,
        http.post("p", b"", {}) as response,
    ):
        async for piece in response.aiter_bytes():
            pieces.append(piece)
            await asyncio.sleep(0.5)
    assert pieces == [b"a", b"b"]


async def test_no_listener_is_a_connect_error() -> None:
    listening = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    listening.close()
    await listening.wait_closed()
    http = Http1Pool(
        f"http://127.0.0.1:{port}", max_connections=1, connect_timeout=1, read_timeout=1, headers={}
    )
    with pytest.raises(httpx.ConnectError, match="cannot connect"):
        await call(http)


async def test_calls_past_the_pool_wait_for_a_connection_and_time_out_waiting() -> None:
    release = asyncio.Event()

    async def held_by_its_reader() -> bytes:
        async with http.post("p", b"", {}) as response:
            pieces = response.aiter_bytes()
            first = await anext(pieces)
            await release.wait()  # the connection is taken while its caller holds it
            return first + b"".join([piece async for piece in pieces])

    answer = sends(CHUNKED_HEAD + chunked(b"o", b"k"))
    async with serving(answer) as server, pool(server, max_connections=1, read_timeout=0.3) as http:
        first = asyncio.create_task(held_by_its_reader())
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await call(http)
        second = asyncio.create_task(call(http))
        await asyncio.sleep(0.05)
        release.set()
        assert await first == (await second)[2] == b"ok"
    assert server.connections == 1


async def test_a_kept_alive_connection_the_server_closed_fails_unanswered() -> None:
    """How llama.cpp's server drops a connection after a streamed answer: the next request
    on it gets no byte back (the provider sends it again on a fresh connection)."""

    async def once(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # read the request, close without a byte
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async with serving(once) as server, pool(server) as http:
        await call(http)
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await call(http)
        assert (await call(http))[2] == b"ok"
    assert server.connections == 2


def test_a_header_that_would_split_the_request_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        Http1Pool(
            "http://127.0.0.1:1",
            max_connections=1,
            connect_timeout=1,
            read_timeout=1,
            headers={"Authorization": "Bearer k\r\nX-Evil: 1"},
        )
    for url in ("https://api.test", "http://user:secret@models.test"):
        with pytest.raises(ValueError, match="not an http:// URL without credentials"):
            Http1Pool(url, max_connections=1, connect_timeout=1, read_timeout=1, headers={})


def test_only_plain_http_without_a_proxy_goes_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert _direct_http("http://127.0.0.1:8000/v1")
    assert not _direct_http("https://api.openai.com/v1")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    assert not _direct_http("http://models.test/v1")
    monkeypatch.setenv("NO_PROXY", "models.test")
    assert _direct_http("http://models.test/v1")
    monkeypatch.setenv("NO_PROXY", ".models.test")  # subdomains only, as httpx reads it
    assert not _direct_http("http://models.test/v1")
    assert _direct_http("http://gpu1.models.test/v1")
    assert not _direct_http("http://user:secret@other.test/v1")  # Basic auth: httpx's
