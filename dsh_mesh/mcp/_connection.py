"""One node's one connection to one MCP server: opened on first use, shared by every resident
agent, bounded in concurrency, closed when idle and when the node drains.

The SDK loads with the first connection a node opens, not with the node: it is half of a node's
start-up time, and most nodes of most clusters name no MCP server. It loads on a worker thread:
half a second on the event loop would hold up the node's lease keepalive."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio

from dsh_mesh.mcp._config import McpServerConfig
from dsh_mesh.mcp._frames import frame_limit
from dsh_mesh.mcp._stdio import KILL_BOUND, StderrTail, StdioServer

if TYPE_CHECKING:
    import mcp_types
    from mcp import Client

_log = logging.getLogger(__name__)

Spawn = Callable[[Awaitable[None], str], asyncio.Task[None]]
"""Starts a task in the owner's task group (the connection owns no tasks of its own)."""


_SDK = ("mcp", "mcp.client.stdio", "mcp.client.streamable_http", "mcp_types", "httpx2")
"""The SDK's modules a connection uses."""


async def _load_sdk() -> None:
    if all(name in sys.modules for name in _SDK):
        return
    await asyncio.to_thread(lambda: [importlib.import_module(name) for name in _SDK])


FIRST_BACKOFF = 0.5
"""Seconds before the third start of a server whose last two starts failed or that died
twice without a call answered between; each further failure doubles it."""
MAX_BACKOFF = 30.0
"""The longest back-off between starts."""
DEFAULT_GRACE = timedelta(seconds=5)
"""How long a stdio server gets to stop (stdin closed, then SIGTERM) before SIGKILL."""


def backoff(failures: int) -> float:
    """Seconds to wait before starting a server after ``failures`` failures in a row: none
    after one (a server that died once is started again by the next use), then
    :data:`FIRST_BACKOFF` doubling up to :data:`MAX_BACKOFF`."""
    if failures <= 1:
        return 0.0
    return float(min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (failures - 2)))


class McpUnavailable(Exception):
    """The server could not be reached (launched, connected, listed) in time, ended during
    the call, or is in its back-off after failing."""


class McpRefused(Exception):
    """The server answered the request with a JSON-RPC error."""


class McpConnection:
    """The connection of this node to ``config``'s server. :meth:`call` and :meth:`list_tools`
    open it when it is closed (one opening at a time, each bounded by
    ``config.connect_timeout``); it closes after ``config.idle_close`` without a call, and for
    good on :meth:`close`. A connection that broke (the server died, or answered what no call
    asked) is opened again by the next use, after a back-off when it keeps failing
    (:func:`backoff`); a use during the back-off fails at once. A stdio server's stderr is kept
    in a bounded buffer (:meth:`stderr_tail`); stopping one takes at most ``grace`` and a
    kill."""

    def __init__(
        self, config: McpServerConfig, spawn: Spawn, *, grace: timedelta = DEFAULT_GRACE
    ) -> None:
        self.config = config
        self._spawn = spawn
        self._grace = grace.total_seconds()
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._opening = asyncio.Lock()
        self._client: Client | None = None
        self._holder: asyncio.Task[None] | None = None
        self._server: StdioServer | None = None
        self._stderr = StderrTail()
        self._closing = asyncio.Event()
        self._broken = False
        self._failures = 0
        self._retry_at = 0.0
        self._busy = 0
        self._last_used = time.monotonic()
        self._closed = False
        self.opened = 0
        """How many times this connection was opened (for tests and metrics)."""

    @property
    def is_open(self) -> bool:
        return self._client is not None and not self._closing.is_set()

    @property
    def last_exit(self) -> int | None:
        """How the stdio server launched last ended: its exit status (negative: the signal
        that ended it), None while it runs or for a server reached over HTTP."""
        return None if self._server is None else self._server.returncode

    def stderr_tail(self) -> str:
        """The last 64 KiB the stdio server wrote to stderr (across its launches)."""
        return self._stderr.text()

    async def list_tools(self) -> list[mcp_types.Tool]:
        """Every tool the server offers now, page by page."""
        async with self._using("the listing") as client:
            tools: list[mcp_types.Tool] = []
            cursor: str | None = None
            while True:
                page = await client.list_tools(cursor=cursor, cache_mode="refresh")
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    return tools

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, object],
        *,
        meta: Mapping[str, Any],
        on_progress: Callable[[], None],
    ) -> mcp_types.CallToolResult:
        """Call ``tool``; cancelling the caller cancels the call on the server. A call waits
        for one of the ``max_concurrency`` slots; ``on_progress`` is called when it gets one and
        at each progress notification. Raises :class:`McpUnavailable` when the server cannot be
        reached or ends during the call, :class:`McpRefused` when it answers with an error."""

        async def progressed(progress: float, total: float | None, message: str | None) -> None:
            on_progress()

        async with self._using("the call") as client:
            on_progress()  # its turn came: the idle limit runs from now, not from the queue
            result: mcp_types.CallToolResult = await client.call_tool(
                tool, dict(arguments), progress_callback=progressed, meta=dict(meta)
            )
            return result

    async def close(self) -> None:
        """Close the connection for good (idempotent); calls after it fail. Returns within
        ``grace`` and a kill's reaping, whatever the server does."""
        self._closed = True
        self._closing.set()
        await self._retire(cancel=self._client is None)

    @contextlib.asynccontextmanager
    async def _using(self, what: str) -> Any:
        async with self._slots:
            client = await self._open()
            server = self._server
            self._busy += 1
            try:
                yield client
            except Exception as failure:
                if _connection_ended(failure):
                    self._broken = True
                    self._closing.set()  # the next use opens it again
                    ended = "closed the connection" if server is None else server.how_it_ended()
                    raise McpUnavailable(
                        f"MCP server {self.config.name} {ended} during {what}{self._last_words()}"
                    ) from failure
                if _refusal(failure):
                    raise McpRefused(
                        f"MCP server {self.config.name} refused {what}: {failure}"
                    ) from failure
                raise
            else:
                self._failures = 0
            finally:
                self._busy -= 1
                self._last_used = time.monotonic()

    async def _open(self) -> Client:
        async with self._opening:
            name = self.config.name
            if self._closed:
                raise McpUnavailable(f"MCP server {name}: the node is draining")
            if self._client is not None and not self._closing.is_set():
                return self._client
            await self._retire(cancel=False)  # the last one may still be closing (and count)
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                raise McpUnavailable(
                    f"MCP server {name} failed {self._failures} times in a row; in back-off,"
                    f" it is started again in {wait:.1f} s{self._last_words()}"
                )
            try:
                await _load_sdk()
            except Exception as failure:
                raise McpUnavailable(
                    f"MCP server {name}: the MCP SDK does not load: {failure}"
                ) from failure
            if self._closed:  # closed while the last one retired or the SDK loaded
                raise McpUnavailable(f"MCP server {name}: the node is draining")
            ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._broken = False
            self._holder = self._spawn(self._hold(ready), f"mcp {name}")
            try:
                async with asyncio.timeout(self.config.connect_timeout.total_seconds()):
                    client = await asyncio.shield(ready)
            except Exception as failure:
                self._closing.set()
                await self._retire(cancel=True)  # a hung start: its process group goes now
                self._failed()
                why = (
                    f"no answer within {self.config.connect_timeout.total_seconds():g} s"
                    if isinstance(failure, TimeoutError)
                    else f"{type(failure).__name__}: {failure}"
                )
                ended = self._server
                if ended is not None and ended.returncode is not None:
                    why = f"it {ended.how_it_ended()}"
                raise McpUnavailable(
                    f"MCP server {name} did not start: {why}{self._last_words()}"
                ) from failure
            self.opened += 1
            self._client = client
            return client

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        """Own the client for its whole life (the SDK's scopes must be left by the task that
        entered them): enter it, hand it out, wait until it is idle, closed or broken, leave
        it."""
        closing = self._closing  # this holder's own: a later one gets a new event
        try:
            from mcp import Client  # loaded by _open (see the module's docstring)

            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(await self._transport(stack), mode="auto")
                )
                ready.set_result(client)
                idle = self.config.idle_close.total_seconds()
                server = self._server
                ended = asyncio.Event() if server is None else server.ended
                while not closing.is_set() and not ended.is_set():
                    waits = {asyncio.ensure_future(e.wait()) for e in (closing, ended)}
                    try:
                        await asyncio.wait(
                            waits, timeout=idle / 4, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        for waiting in waits:
                            waiting.cancel()
                    quiet = time.monotonic() - self._last_used
                    if self._busy == 0 and quiet >= idle:
                        _log.info(
                            "MCP server %s: closing after %.0f s idle", self.config.name, quiet
                        )
                        break
                if ended.is_set() and not self._closed:
                    self._broken = True
                    _log.warning(
                        "MCP server %s %s%s",
                        self.config.name,
                        "" if server is None else server.how_it_ended(),
                        self._last_words(),
                    )
        except Exception as failure:
            if not ready.done():
                ready.set_exception(failure)
            else:
                self._broken = True
                _log.warning("MCP server %s: connection ended: %s", self.config.name, failure)
        finally:
            closing.set()
            if self._holder is asyncio.current_task():  # not a later holder's client
                self._client = None
            if not ready.done():  # cancelled while it started: whoever waits hears of it
                ready.set_exception(McpUnavailable("the connection was closed while it started"))
            if self._broken and not self._closed:
                self._failed()

    def _failed(self) -> None:
        self._broken = False
        self._failures += 1
        self._retry_at = time.monotonic() + backoff(self._failures)

    async def _retire(self, *, cancel: bool) -> None:
        """Wait for the last holder to end, within ``grace`` and a kill: cancel it (and so stop
        its server) first when ``cancel``; past the bound, kill its process group."""
        holder = self._holder
        if holder is None or holder.done():
            return
        if cancel:
            holder.cancel()
        done, _ = await asyncio.wait({holder}, timeout=self._grace + KILL_BOUND)
        if not done:
            if self._server is not None:
                self._server.kill()
            holder.cancel()
            await asyncio.wait({holder}, timeout=KILL_BOUND)

    def _last_words(self) -> str:
        words = self._stderr.last_lines()
        return f"; its last stderr: {words}" if words else ""

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        from mcp.client.streamable_http import streamable_http_client

        config = self.config
        if config.command is not None:
            self._server = StdioServer(
                [
                    sys.executable,
                    "-m",
                    "dsh_mesh.mcp._reaper",
                    str(os.getpid()),
                    "--",
                    config.command,
                    *config.args,
                ],
                env={**os.environ, **config.env},
                cwd=config.cwd,
                frame_limit=frame_limit(config.limits.max_output_chars),
                max_output_chars=config.limits.max_output_chars,
                stderr=self._stderr,
                grace=self._grace,
            )
            return self._server.streams()
        assert config.url is not None
        from dsh_mesh.mcp._http import bounded_client  # imports httpx2: loaded by now

        limit = frame_limit(config.limits.max_output_chars)
        http = await stack.enter_async_context(
            bounded_client(
                config.headers, limit=limit, max_output_chars=config.limits.max_output_chars
            )
        )
        return streamable_http_client(
            config.url,
            http_client=http,
            max_sse_event_size=limit,
        )


def _connection_ended(failure: Exception) -> bool:
    """Whether ``failure`` says the connection ended (not that the server refused)."""
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED

    if isinstance(failure, MCPError):
        return failure.code == CONNECTION_CLOSED
    return isinstance(failure, OSError | anyio.ClosedResourceError | anyio.BrokenResourceError)


def _refusal(failure: Exception) -> bool:
    from mcp.shared.exceptions import MCPError

    return isinstance(failure, MCPError)
