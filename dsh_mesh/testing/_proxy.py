"""A small asyncio TCP proxy that adds delay and loss in front of one server.

The test machine's kernel has no ``netem``, so a link's latency and loss cannot be shaped with
``tc``. :class:`TcpProxy` stands in for such a link: it listens on one address, opens one
upstream connection per accepted client, and forwards both directions chunk by chunk, holding
every chunk back by ``delay`` (plus up to ``jitter``) seconds. A chunk that is "lost" (with
probability ``loss``) is delivered ``retransmit_delay`` seconds later still, which is what loss
looks like to a TCP application: the stream stays whole and in order, and the segment arrives
after the sender's retransmission timeout (200 ms is Linux's minimum RTO). Bytes are never
reordered, duplicated or dropped, so the protocol above (gRPC here) sees a slow, jittery link,
not a corrupt one. :meth:`TcpProxy.reset_all` cuts every open connection, as a broken link does.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from dataclasses import dataclass
from types import TracebackType
from typing import Self

_CHUNK = 65536


@dataclass(kw_only=True)
class ProxyStats:
    """What a :class:`TcpProxy` has forwarded so far (both directions added up)."""

    connections: int = 0
    """Client connections accepted."""
    chunks: int = 0
    """Chunks forwarded."""
    bytes: int = 0
    """Bytes forwarded."""
    lost: int = 0
    """Chunks that were "lost" and so held back by the retransmission delay as well."""


class TcpProxy:
    """Forwards TCP connections from ``listen`` to ``upstream`` with added delay and loss.

    ``listen`` is ``(host, port)``; port 0 picks a free one (see :attr:`port`). ``upstream`` is
    ``(host, port)``; a port of 0 means the proxy's own listening port, so a proxy on another
    address can stand in front of a server on the same port. ``delay``, ``jitter``, ``loss`` and
    ``retransmit_delay`` are described in the module docstring and may be changed at any time
    with :meth:`shape`; ``seed`` makes the loss draws repeatable.

    Lifecycle: ``await start()`` returns once the proxy listens; ``await close()`` stops
    listening and cuts every connection, and is idempotent; ``async with TcpProxy(...)`` does
    both. Use from one event loop; every connection's tasks belong to a task group of its own.
    """

    def __init__(
        self,
        *,
        listen: tuple[str, int],
        upstream: tuple[str, int],
        delay: float = 0.0,
        jitter: float = 0.0,
        loss: float = 0.0,
        retransmit_delay: float = 0.2,
        seed: int | None = None,
    ) -> None:
        self._listen = listen
        self._upstream = upstream
        self._random = random.Random(seed)
        self.delay = 0.0
        self.jitter = 0.0
        self.loss = 0.0
        self.retransmit_delay = 0.0
        self.shape(delay=delay, jitter=jitter, loss=loss, retransmit_delay=retransmit_delay)
        self.stats = ProxyStats()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._port: int | None = None

    def shape(
        self,
        *,
        delay: float | None = None,
        jitter: float | None = None,
        loss: float | None = None,
        retransmit_delay: float | None = None,
    ) -> None:
        """Change the link's shape; applies to every chunk read from now on. Raises
        ``ValueError`` for a negative duration or a loss outside [0, 1)."""
        values = {
            "delay": self.delay if delay is None else delay,
            "jitter": self.jitter if jitter is None else jitter,
            "retransmit_delay": (
                self.retransmit_delay if retransmit_delay is None else retransmit_delay
            ),
        }
        for name, value in values.items():
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        new_loss = self.loss if loss is None else loss
        if not 0.0 <= new_loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {new_loss}")
        self.delay = values["delay"]
        self.jitter = values["jitter"]
        self.retransmit_delay = values["retransmit_delay"]
        self.loss = new_loss

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self._listen[0]

    @property
    def port(self) -> int:
        """The port the proxy listens on; raises ``RuntimeError`` before :meth:`start`."""
        if self._port is None:
            raise RuntimeError("the proxy is not listening yet")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` to dial instead of the upstream server."""
        return f"{self.host}:{self.port}"

    @property
    def upstream(self) -> tuple[str, int]:
        """Where connections are forwarded to (with the real port once listening)."""
        host, port = self._upstream
        return host, port or self.port

    async def start(self) -> Self:
        """Bind and listen; returns once connections are accepted."""
        if self._server is not None:
            raise RuntimeError("the proxy is already started")
        host, port = self._listen
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        self._port = int(sock.getsockname()[1])
        self._server = await asyncio.start_server(self._accept, sock=sock)
        return self

    async def close(self) -> None:
        """Stop listening and cut every open connection. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await self.reset_all()
        if server is not None:
            await server.wait_closed()

    async def reset_all(self) -> None:
        """Cut every open connection (clients see the connection drop); keep listening."""
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------

    async def _accept(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self.stats.connections += 1
        try:
            await self._relay(client_reader, client)
        except asyncio.CancelledError:
            # The proxy is closing. End quietly: asyncio's stream server logs a handler task
            # that ends cancelled as an error of its own.
            pass
        finally:
            self._connections.discard(task)

    async def _relay(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        try:
            host, port = self.upstream
            try:
                upstream_reader, upstream = await asyncio.open_connection(host, port)
            except OSError:
                return
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pipe(client_reader, upstream))
                    group.create_task(self._pipe(upstream_reader, client))
            finally:
                upstream.close()
        except* (ConnectionError, OSError):
            pass  # either side went away: the other one is closed below
        finally:
            client.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read chunks as they come, write each at its release time, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def read() -> None:
            last = 0.0
            while True:
                chunk = await reader.read(_CHUNK)
                release = loop.time() + self.delay + self._random.uniform(0.0, self.jitter)
                if chunk and self.loss and self._random.random() < self.loss:
                    self.stats.lost += 1
                    release += self.retransmit_delay
                # A TCP stream never overtakes itself: a chunk waits for the one before it.
                last = max(last, release)
                await queue.put((last, chunk))
                if not chunk:
                    return

        async def write() -> None:
            while True:
                release, chunk = await queue.get()
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
                self.stats.chunks += 1
                self.stats.bytes += len(chunk)

        async with asyncio.TaskGroup() as group:
            group.create_task(read())
            group.create_task(write())
