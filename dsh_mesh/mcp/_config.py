"""How a node reaches one MCP server: a stdio command it launches, or a streamable-HTTP URL."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from dsh_mesh.tools import CallLimits

SERVER_NAME = re.compile(r"[A-Za-z0-9-]{1,32}")
"""What a server's name may be: it prefixes its tools' names (``<server>__<tool>``)."""
SEPARATOR = "__"
SELECTOR_PREFIX = "mcp:"
"""A preset names a server's tools as ``mcp:<server>`` (all of them, in the server's order)
or ``mcp:<server>/<tool>`` (one); ``mcp:<server>/<tool>`` is also the tool's canonical name,
which ``approve_tools`` patterns match."""


@dataclass(frozen=True, kw_only=True)
class McpServerConfig:
    """One MCP server, as every node of a cluster declares it (the presets file's
    ``[mcp.servers.<name>]``).

    Exactly one of ``command`` (a stdio server: the node launches ``command`` with ``args``,
    ``env`` added to its own environment, in ``cwd``) and ``url`` (a streamable-HTTP server,
    sent ``headers``) is set. ``limits`` bound each call of its tools; ``max_concurrency``
    bounds the calls in flight on the node's one connection; ``idle_close`` closes the
    connection after that long without a call (the next call opens it again);
    ``connect_timeout`` bounds opening it and listing its tools. ``safe_tools`` names the
    tools whose calls may run again under the same idempotency key after a host death
    (``replay = "safe"``); every other tool of the server is unsafe."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    limits: CallLimits = field(default_factory=CallLimits)
    max_concurrency: int = 16
    idle_close: timedelta = timedelta(minutes=5)
    connect_timeout: timedelta = timedelta(seconds=30)
    safe_tools: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not SERVER_NAME.fullmatch(self.name):
            raise ValueError(f"MCP server name {self.name!r}: use 1 to 32 letters, digits or '-'")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: set exactly one of command, url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: url must be http:// or https://")
        if self.max_concurrency < 1:
            raise ValueError(f"MCP server {self.name!r}: max_concurrency must be at least 1")
        for span, label in ((self.idle_close, "idle_close"), (self.connect_timeout, "connect")):
            if span <= timedelta(0):
                raise ValueError(f"MCP server {self.name!r}: {label} must be positive")

    def tool_name(self, tool: str) -> str:
        """The name the model sees for the server's ``tool``."""
        return f"{self.name}{SEPARATOR}{tool}"


def split_tool_name(name: str) -> tuple[str, str] | None:
    """``(server, tool)`` of a model-visible MCP tool name, or None for any other name."""
    server, separator, tool = name.partition(SEPARATOR)
    if not separator or not tool or not SERVER_NAME.fullmatch(server):
        return None
    return server, tool
