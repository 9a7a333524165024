"""A paced OpenAI-compatible chat-completions server in its own process: what the ``streaming``
section's agents (and its bare httpx floor) stream from.

Every ``POST`` is answered, at once, with a streamed completion (HTTP/1.1, chunked, kept alive):
the role chunk, then :data:`TOKENS` content chunks of one token each, one every
:data:`INTERVAL` seconds (a model's pace: 50 tokens a second), then a call of the ``tick`` tool
(or, once told to ``finish``, no call: the agent's turn ends), the usage chunk and ``[DONE]``.
Nothing in a request is parsed but its ``Content-Length``: the server's own CPU is kept small,
since it shares the machine with what is measured. One ticker writes the next chunk of every
open stream at once.

It starts holding every request unanswered (so agents created while it holds cost the node
nothing until all are there), prints its base URL once it listens, then reads commands on
stdin, one per line, each answered by one line of JSON:

- ``release``: answers every request held, and every later one at once;
- ``stats``: ``{"requests": R, "written": W, "open": O, "held": H}`` (requests received and
  answers written whole since start, streams open and requests held now). A client's next
  request says it has read its last answer: the written ones may still wait in its socket;
- ``finish``: every later answer ends without a tool call;
- end of input, or SIGTERM: stops.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import sys
import time
from dataclasses import dataclass

TOKENS = 48
"""Content chunks (one token each) of every answer."""
INTERVAL = 0.02
"""Seconds between two chunks of a stream: 50 tokens a second."""
TOOL = "tick"
"""The tool every answer calls until ``finish``."""
_MODEL = "bench-stream"
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)


def _event(body: dict[str, object]) -> bytes:
    data = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _chunk(delta: dict[str, object], finish_reason: str | None = None) -> bytes:
    return _event(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": _MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
    )


_ROLE = _chunk({"role": "assistant", "content": ""})
_TOKEN = _chunk({"content": " tok"})
_USAGE = _event(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": _MODEL,
        "choices": [],
        "usage": {"prompt_tokens": 100, "completion_tokens": TOKENS, "total_tokens": 100 + TOKENS},
    }
)
_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
_STOP = _chunk({}, "stop") + _USAGE + _END


def _called(call_id: str) -> bytes:
    call = {"index": 0, "id": call_id, "type": "function"}
    call["function"] = {"name": TOOL, "arguments": "{}"}
    return _chunk({"tool_calls": [call]}) + _chunk({}, "tool_calls") + _USAGE + _END


@dataclass
class _Stream:
    transport: asyncio.Transport
    left: int


class StreamServer:
    """The listener, the open streams and the counters."""

    def __init__(self) -> None:
        self.holding = True
        self.finishing = False
        self._held: list[asyncio.Transport] = []
        self.requests = 0
        self.written = 0
        self._open: list[_Stream] = []
        self._calls = itertools.count()

    def start(self, transport: asyncio.Transport) -> None:
        """Answer a request that arrived whole on ``transport`` (or hold it)."""
        self.requests += 1
        if self.holding:
            self._held.append(transport)
            return
        self._answer(transport)

    def _answer(self, transport: asyncio.Transport) -> None:
        """Begin a streamed answer on ``transport``: its head and role chunk now, its tokens
        at the ticks to come."""
        transport.write(_HEAD + _ROLE)
        self._open.append(_Stream(transport, TOKENS))

    async def tick(self) -> None:
        """Write the next chunk of every open stream, every :data:`INTERVAL` seconds."""
        due = time.monotonic()
        while True:
            due += INTERVAL
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - INTERVAL)  # behind: never burst to catch up
            still: list[_Stream] = []
            for stream in self._open:
                if stream.transport.is_closing():
                    continue
                stream.transport.write(_TOKEN)
                stream.left -= 1
                if stream.left:
                    still.append(stream)
                    continue
                self.written += 1
                if self.finishing:
                    stream.transport.write(_STOP)
                else:
                    stream.transport.write(_called(f"call_{next(self._calls)}"))
            self._open = still

    def release(self) -> None:
        """Stop holding: answer what was held."""
        self.holding = False
        held, self._held = self._held, []
        for transport in held:
            if not transport.is_closing():
                self._answer(transport)

    def stats(self) -> dict[str, int]:
        """The counters, for the ``stats`` command."""
        return {
            "requests": self.requests,
            "written": self.written,
            "open": len(self._open),
            "held": len(self._held),
        }


class _Connection(asyncio.Protocol):
    """One kept-alive client connection: requests one after another, each answered by a
    stream once its body has arrived."""

    def __init__(self, server: StreamServer) -> None:
        self._server = server
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = 0
            for line in self._buffer[:head_end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            end = head_end + 4 + length
            if len(self._buffer) < end:
                return
            self._buffer = self._buffer[end:]
            assert self._transport is not None
            self._server.start(self._transport)


async def _commands(server: StreamServer, stop: asyncio.Event) -> None:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = line.decode().strip()
        if command == "stats":
            print(json.dumps(server.stats()), flush=True)
        elif command == "finish":
            server.finishing = True
            print("{}", flush=True)
        elif command == "release":
            server.release()
            print("{}", flush=True)
    stop.set()


async def _serve() -> None:
    server = StreamServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Connection(server), sock=sock, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    ticker = asyncio.create_task(server.tick())
    commands = asyncio.create_task(_commands(server, stop))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    await stop.wait()
    ticker.cancel()
    commands.cancel()
    listener.close()


if __name__ == "__main__":
    asyncio.run(_serve())
