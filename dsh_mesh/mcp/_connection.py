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
from typing import TYPE_CHECKING, Any

import anyio

from dsh_mesh.mcp._config import McpServerConfig

if TYPE_CHECKING:
    import mcp_types
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

_log = logging.getLogger(__name__)

Spawn = Callable[[Awaitable[None], str], asyncio.Task[None]]
"""Starts a task in the owner's task group (the connection owns no tasks of its own)."""


_SDK = ("mcp", "mcp.client.stdio", "mcp.client.streamable_http", "mcp_types", "httpx2")
"""The SDK's modules a connection uses."""


async def _load_sdk() -> None:
    if all(name in sys.modules for name in _SDK):
        return
    await asyncio.to_thread(lambda: [importlib.import_module(name) for name in _SDK])


class McpUnavailable(Exception):
    """The server could not be reached (launched, connected, listed) in time."""


class McpConnection:
    """The connection of this node to ``config``'s server. :meth:`call` and :meth:`list_tools`
    open it when it is closed (one opening at a time); it closes after ``config.idle_close``
    without a call, and for good on :meth:`close`. A connection that broke (the server died)
    is opened again by the next call."""

    def __init__(self, config: McpServerConfig, spawn: Spawn) -> None:
        self.config = config
        self._spawn = spawn
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._opening = asyncio.Lock()
        self._client: Client | None = None
        self._holder: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._busy = 0
        self._last_used = time.monotonic()
        self._closed = False
        self.opened = 0
        """How many times this connection was opened (for tests and metrics)."""

    @property
    def is_open(self) -> bool:
        return self._client is not None and not self._closing.is_set()

    async def list_tools(self) -> list[mcp_types.Tool]:
        """Every tool the server offers now, page by page."""
        async with self._using() as client:
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
        at each progress notification."""

        async def progressed(progress: float, total: float | None, message: str | None) -> None:
            on_progress()

        async with self._using() as client:
            on_progress()  # its turn came: the idle limit runs from now, not from the queue
            result: mcp_types.CallToolResult = await client.call_tool(
                tool, dict(arguments), progress_callback=progressed, meta=dict(meta)
            )
            return result

    async def close(self) -> None:
        """Close the connection for good (idempotent); calls after it fail."""
        self._closed = True
        self._closing.set()
        holder = self._holder
        if holder is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(holder), 10)

    @contextlib.asynccontextmanager
    async def _using(self) -> Any:
        async with self._slots:
            client = await self._open()
            self._busy += 1
            try:
                yield client
            except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError) as broken:
                self._closing.set()  # the next call opens it again
                raise McpUnavailable(f"MCP server {self.config.name}: {broken}") from broken
            finally:
                self._busy -= 1
                self._last_used = time.monotonic()

    async def _open(self) -> Client:
        async with self._opening:
            if self._closed:
                raise McpUnavailable(f"MCP server {self.config.name}: the node is draining")
            if self._client is not None and not self._closing.is_set():
                return self._client
            if self._holder is not None and not self._holder.done():
                await asyncio.wait([self._holder])  # the last one is still closing
            try:
                await _load_sdk()
            except Exception as failure:
                raise McpUnavailable(
                    f"MCP server {self.config.name}: the MCP SDK does not load: {failure}"
                ) from failure
            ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._holder = self._spawn(self._hold(ready), f"mcp {self.config.name}")
            try:
                async with asyncio.timeout(self.config.connect_timeout.total_seconds()):
                    client = await asyncio.shield(ready)
            except Exception as failure:
                self._closing.set()
                raise McpUnavailable(
                    f"MCP server {self.config.name} did not start: {type(failure).__name__}:"
                    f" {failure}"
                ) from failure
            self.opened += 1
            self._client = client
            return client

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        """Own the client for its whole life (the SDK's scopes must be left by the task that
        entered them): enter it, hand it out, wait until it is idle or closed, leave it."""
        try:
            from mcp import Client  # loaded by _open (see the module's docstring)

            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(await self._server(stack), mode="auto")
                )
                ready.set_result(client)
                idle = self.config.idle_close.total_seconds()
                while not self._closing.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._closing.wait(), idle / 4)
                    quiet = time.monotonic() - self._last_used
                    if self._busy == 0 and quiet >= idle:
                        _log.info(
                            "MCP server %s: closing after %.0f s idle", self.config.name, quiet
                        )
                        break
        except Exception as failure:
            if not ready.done():
                ready.set_exception(failure)
            else:
                _log.warning("MCP server %s: connection ended: %s", self.config.name, failure)
        finally:
            self._closing.set()
            self._client = None

    async def _server(self, stack: contextlib.AsyncExitStack) -> StdioServerParameters | Any:
        from mcp.client.stdio import StdioServerParameters
        from mcp.client.streamable_http import streamable_http_client

        config = self.config
        if config.command is not None:
            return StdioServerParameters(
                command=sys.executable,
                args=[
                    "-m",
                    "dsh_mesh.mcp._reaper",
                    str(os.getpid()),
                    "--",
                    config.command,
                    *config.args,
                ],
                env={**os.environ, **config.env},
                cwd=config.cwd,
            )
        assert config.url is not None
        import httpx2

        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers=dict(config.headers), timeout=None)
        )
        return streamable_http_client(config.url, http_client=http)
