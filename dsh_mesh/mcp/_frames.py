"""A stdio MCP server's stdout as newline-delimited JSON-RPC frames, each held to a bound while
it is read: a frame over the bound is never buffered whole. Its head and tail are kept, the
rest is dropped as it streams past, and the answer it carried is made up from what was kept
(ADR 0029, "Fault model of MCP servers")."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FRAME_FLOOR = 4 * 1024 * 1024
"""The least bound on one message from a stdio server, in bytes: room for a large tool
listing or a few images, whatever the output limit."""
TAIL_BYTES = 4096
"""Bytes kept of the end of a frame over the bound: a server may write ``"id"`` last."""
INTERNAL_ERROR = -32603
CUT_META = "dsh.mesh/cut"
"""The ``_meta`` key of a result made up for an answer over the bound: ``{"isError": <what
the server's answer said>, "bytes": <its size>}``. The made-up result itself says
``isError: true``, so that the SDK does not hold it to the tool's output schema (its
structured content was never read); the tool reads the server's own flag back from here."""


def frame_limit(max_output_chars: int) -> int:
    """The bound on one message from a server whose calls show ``max_output_chars``: a text
    that long, each character escaped as ``\\uXXXX`` with a surrogate pair to spare, fits."""
    return max(FRAME_FLOOR, 12 * max_output_chars + 64 * 1024)


@dataclass(frozen=True)
class Frame:
    """One line the server wrote. ``data`` is all of it when ``size <= limit``; otherwise its
    first ``limit`` bytes, and ``tail`` its last :data:`TAIL_BYTES`."""

    data: bytes
    size: int
    limit: int
    tail: bytes = b""

    @property
    def whole(self) -> bool:
        return self.size <= self.limit


class FrameReader:
    """Cuts a byte stream into frames at ``\\n``, holding at most ``limit`` bytes of one (and
    :data:`TAIL_BYTES` of its end). Not thread-safe; one reader per stream."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._limit = limit
        self._head = bytearray()
        self._tail = b""
        self._size = 0

    def feed(self, chunk: bytes) -> list[Frame]:
        """The frames ``chunk`` completes (empty lines are skipped)."""
        frames: list[Frame] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            self._take(chunk[start:] if end < 0 else chunk[start:end])
            if end < 0:
                return frames
            if self._size:
                frames.append(Frame(bytes(self._head), self._size, self._limit, self._tail))
            self._head.clear()
            self._tail = b""
            self._size = 0
            start = end + 1

    def _take(self, piece: bytes) -> None:
        if not piece:
            return
        self._size += len(piece)
        room = self._limit - len(self._head)
        if room > 0:
            self._head += piece[:room]
        if self._size > self._limit:
            self._tail = (self._tail + piece[-TAIL_BYTES:])[-TAIL_BYTES:]


_ID = rb'(-?\d+|"(?:[^"\\]|\\.)*")'
_HEAD_ID = re.compile(rb'\A\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*' + _ID)
_TAIL_ID = re.compile(rb'"id"\s*:\s*' + _ID + rb'\s*(?:,\s*"jsonrpc"\s*:\s*"2\.0"\s*)?\}\s*\Z')
_TEXT = re.compile(rb'"text"\s*:\s*"')
_IS_ERROR = re.compile(rb'"isError"\s*:\s*true')


def answer_for_oversized(
    frame: Frame, pending: Mapping[Any, str], max_output_chars: int
) -> dict[str, Any] | None:
    """The JSON-RPC answer to stand for ``frame`` (over its bound), or None when it answers
    none of the ``pending`` requests (id -> method) as far as its head and tail tell.

    An answer to ``tools/call`` becomes a result holding the start of its first text part
    (what fits in ``max_output_chars`` beside a note of the cut); an answer to any other
    request becomes a JSON-RPC error saying how large it was."""
    request_id = _id_of(frame)
    if request_id is None or request_id not in pending:
        return None
    method = pending[request_id]
    if method != "tools/call":
        return {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {
                "code": INTERNAL_ERROR,
                "message": f"the server's answer to {method} was {frame.size:,} bytes, over"
                f" the limit of {frame.limit:,} bytes on one message; it was dropped",
            },
        }
    text = _first_text(frame.data)

    def note(shown: int) -> str:
        kept = (
            "it held no text in the part read"
            if text is None
            else f"only the start of its first text part, {shown:,} characters, is shown"
        )
        return (
            f"\n[output cut: the server's answer was {frame.size:,} bytes, over the limit of"
            f" {frame.limit:,} bytes on one message; {kept}]"
        )

    kept = "" if text is None else text[: max(0, max_output_chars - len(note(max_output_chars)))]
    is_error = bool(_IS_ERROR.search(frame.data) or _IS_ERROR.search(frame.tail))
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "result": {
            "resultType": "complete",  # required by the 2026 schema, ignored by older ones
            "content": [{"type": "text", "text": kept + note(len(kept))}],
            "isError": True,
            "_meta": {CUT_META: {"isError": is_error, "bytes": frame.size}},
        },
    }


def _id_of(frame: Frame) -> Any:
    found = _HEAD_ID.match(frame.data) or _TAIL_ID.search(frame.tail)
    if found is None:
        return None
    try:
        return json.loads(found.group(1))
    except ValueError:
        return None


def _first_text(head: bytes) -> str | None:
    """The first ``"text"`` string of ``head``'s ``content``, decoded as far as ``head``
    holds it."""
    content = head.find(b'"content"')
    found = _TEXT.search(head, max(content, 0))
    if content < 0 or found is None:
        return None
    body = head[found.end() :].decode("utf-8", "ignore")
    try:
        text, _ = json.JSONDecoder().raw_decode('"' + body)  # the string, not what follows
        return str(text)
    except ValueError:
        pass  # cut inside the string: decode what there is, less a half escape at the end
    for trim in range(12):
        try:
            return str(json.loads('"' + body[: len(body) - trim] + '"'))
        except ValueError:
            continue
    return None
