"""The MCP servers of one node: one connection each, their tools by name."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Self

from dsh_mesh.core import ToolDescriptor, ToolsUnavailable
from dsh_mesh.mcp._config import SELECTOR_PREFIX, McpServerConfig, split_tool_name
from dsh_mesh.mcp._connection import DEFAULT_GRACE, McpConnection, McpRefused, McpUnavailable
from dsh_mesh.mcp._tool import McpTool, descriptor_of
from dsh_mesh.tools import Tool

LISTING_TTL = 60.0
"""Seconds a server's tool listing serves new sessions before it is listed again. A session
keeps the descriptors it was created with, whatever the server lists later."""


class McpServers:
    """Every MCP server a node declares. Use as ``async with``: it owns each connection's task
    in its task group; leaving it closes every connection (and so ends every stdio server it
    launched) within ``grace`` and a kill's reaping, whatever the servers do. Implements the
    tool registry's ``ToolSource``: presets select its tools with ``mcp:`` selectors; a resumed
    session's recorded MCP descriptors are bound to their servers."""

    def __init__(
        self, configs: Sequence[McpServerConfig], *, grace: timedelta = DEFAULT_GRACE
    ) -> None:
        self._configs = {config.name: config for config in configs}
        self._grace = grace
        self._connections: dict[str, McpConnection] = {}
        self._listings: dict[str, tuple[McpTool, ...]] = {}
        self._listed_at: dict[str, float] = {}
        self._group: asyncio.TaskGroup | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        self._group = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._connections = {
            name: McpConnection(config, self._spawn, grace=self._grace)
            for name, config in self._configs.items()
        }
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self.close()
        await self._stack.__aexit__(kind, error, trace)

    async def close(self) -> None:
        """Close every connection (idempotent)."""
        await asyncio.gather(*(c.close() for c in self._connections.values()))

    def connection(self, server: str) -> McpConnection:
        """The node's connection to ``server`` (KeyError for an undeclared one)."""
        return self._connections[server]

    # -- the registry's ToolSource ----------------------------------------------------------------

    def selects(self, selector: str) -> bool:
        """Whether ``selector`` is one of this source's (``mcp:...``)."""
        return selector.startswith(SELECTOR_PREFIX)

    async def load(self, selector: str) -> None:
        """List the selected server's tools (opening its connection) unless listed within
        :data:`LISTING_TTL`. Raises :class:`ToolsUnavailable` when the server cannot be reached
        or lacks the tool, ends during the listing, refuses it, or is in its back-off."""
        server, _, tool = selector.removeprefix(SELECTOR_PREFIX).partition("/")
        if server not in self._connections:
            raise ToolsUnavailable(
                f"no MCP server {server!r} is declared on this node",
                metadata={"tool": selector, "problem": "missing"},
            )
        fresh = time.monotonic() - self._listed_at.get(server, -LISTING_TTL) < LISTING_TTL
        if not fresh:
            connection = self._connections[server]
            try:
                listed = await connection.list_tools()
            except (McpUnavailable, McpRefused) as unavailable:
                raise ToolsUnavailable(
                    str(unavailable), metadata={"tool": selector, "problem": "unreachable"}
                ) from unavailable
            config = connection.config
            self._listings[server] = tuple(
                McpTool(connection, t.name, descriptor_of(config.tool_name(t.name), t))
                for t in listed
            )
            self._listed_at[server] = time.monotonic()
        if tool and not any(
            t.descriptor.name.endswith(f"__{tool}") for t in self._listings[server]
        ):
            raise ToolsUnavailable(
                f"MCP server {server!r} offers no tool {tool!r}",
                metadata={"tool": selector, "problem": "missing"},
            )

    def select(self, selector: str) -> tuple[Tool, ...]:
        """The tools ``selector`` names, from the last listing (:meth:`load` first)."""
        server, _, tool = selector.removeprefix(SELECTOR_PREFIX).partition("/")
        listed = self._listings.get(server, ())
        if not tool:
            return listed
        name = self._configs[server].tool_name(tool)
        return tuple(t for t in listed if t.descriptor.name == name)

    def bind(self, descriptor: ToolDescriptor) -> Tool | None:
        """A tool for a session's recorded ``descriptor`` of an MCP tool (calls go to its
        server by the tool's name; the model keeps seeing the recorded descriptor), or None
        when no declared server's name prefixes it."""
        split = split_tool_name(descriptor.name)
        if split is None or split[0] not in self._connections:
            return None
        return McpTool(self._connections[split[0]], split[1], descriptor)

    def _spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        if self._group is None:
            raise RuntimeError("McpServers is not running: use `async with`")
        return self._group.create_task(work, name=name)  # type: ignore[arg-type]
