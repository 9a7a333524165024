"""Minimal HTTP/1.1 framing on asyncio streams, for the local test servers.

It reads a request head and a body sent by ``Content-Length`` or ``Transfer-Encoding:
chunked``, frames one chunk of a chunked response, and waits for the peer to close. Bytes that
are not a request it can read raise :class:`BadRequest`. It knows nothing of what is served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

HEAD_LINE_LIMIT = 1 << 16
_MAX_BODY = 1 << 28
_READ_SIZE = 1 << 16


# -- reading requests ---------------------------------------------------------------------------


class BadRequest(Exception):
    """The bytes are not an HTTP/1.1 request this server can read; answered 400, then closed."""


@dataclass(frozen=True, kw_only=True)
class RequestHead:
    """A request line and its headers (lower-case names, repeats joined with ``", "``)."""

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
        raise BadRequest("a request line or header is too long") from long
    if not line.endswith(b"\n"):
        raise asyncio.IncompleteReadError(line, None)
    return line


async def read_head(reader: asyncio.StreamReader) -> RequestHead | None:
    """The request line and headers, or None at a clean end of the connection."""
    try:
        first = await reader.readline()
    except ValueError as long:
        raise BadRequest("the request line is too long") from long
    if not first:
        return None
    if not first.endswith(b"\n"):
        raise asyncio.IncompleteReadError(first, None)
    parts = first.decode("latin-1").strip().split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"not an HTTP/1.x request line: {first[:100]!r}")
    method, target, version = parts
    headers: dict[str, str] = {}
    while (line := await _read_line(reader)) not in (b"\r\n", b"\n"):
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon or not name.strip():
            raise BadRequest(f"a malformed header line: {line[:100]!r}")
        key, value = name.strip().lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return RequestHead(method=method, target=target, version=version, headers=headers)


async def read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    """The body the headers announce, de-chunked; empty when they announce none."""
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.split(",")[-1].strip().lower() != "chunked":
            raise BadRequest(f"an unsupported Transfer-Encoding: {coding}")
        return await _read_chunked(reader)
    length = headers.get("content-length")
    if length is None:
        return b""
    if not length.isdigit() or int(length) > _MAX_BODY:
        raise BadRequest(f"a bad Content-Length: {length!r}")
    return await reader.readexactly(int(length))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = (await _read_line(reader)).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(f"a bad chunk size: {size_text[:20]!r}") from None
        if size < 0 or total + size > _MAX_BODY:
            raise BadRequest(f"a bad chunk size: {size_text[:20]!r}")
        if size == 0:
            break
        parts.append(await reader.readexactly(size))
        total += size
        if await reader.readexactly(2) != b"\r\n":
            raise BadRequest("a chunk not followed by CRLF")
    while await _read_line(reader) not in (b"\r\n", b"\n"):
        pass  # trailers: nothing here uses them
    return b"".join(parts)


async def until_closed(reader: asyncio.StreamReader) -> None:
    """Wait, without polling, until the peer closes its side; whatever it sends is dropped."""
    while await reader.read(_READ_SIZE):
        pass


# -- writing responses -----------------------------------------------------------------------------


def http_chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a ``Transfer-Encoding: chunked`` body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"
