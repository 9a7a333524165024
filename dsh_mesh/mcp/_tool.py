"""An MCP server's tool as a :class:`~dsh_mesh.tools.Tool`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dsh_mesh.core import ToolDescriptor
from dsh_mesh.mcp._config import SELECTOR_PREFIX
from dsh_mesh.mcp._connection import McpConnection, McpRefused, McpUnavailable
from dsh_mesh.mcp._frames import CUT_META
from dsh_mesh.tools import CallLimits, Replay, ToolIdentity, ToolInvocation, ToolOutput

if TYPE_CHECKING:
    import mcp_types

IDEMPOTENCY_META = "dsh.mesh/idempotency-key"
"""The ``_meta`` key of every ``tools/call`` request that carries the call's idempotency key:
the same when a ``safe`` call runs again after a host death, so the server can find what the
first run did."""


class McpTool:
    """One tool of one MCP server, under the name ``<server>__<tool>``. Its descriptor is the
    one the session recorded (byte-identical from step to step, whatever the server lists
    now); its calls go to the node's one connection to the server."""

    def __init__(
        self,
        connection: McpConnection,
        tool: str,
        descriptor: ToolDescriptor,
    ) -> None:
        config = connection.config
        self._connection = connection
        self._tool = tool
        self._descriptor = descriptor
        self._identity = ToolIdentity(f"{SELECTOR_PREFIX}{config.name}/{tool}")
        self.replay = Replay.SAFE if tool in config.safe_tools else Replay.UNSAFE
        self.limits: CallLimits = config.limits

    def __repr__(self) -> str:
        return f"McpTool({self._descriptor.name!r}, replay={self.replay.value})"

    @property
    def identity(self) -> ToolIdentity:
        return self._identity

    @property
    def canonical_name(self) -> str:
        """``mcp:<server>/<tool>``: how a preset's ``tools`` and ``approve_tools`` name this
        tool (the model sees ``<server>__<tool>``)."""
        return f"{SELECTOR_PREFIX}{self._connection.config.name}/{self._tool}"

    @property
    def descriptor(self) -> ToolDescriptor:
        return self._descriptor

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        """Call the tool on its server with the call's idempotency key in ``_meta``; a
        progress notification resets the call's idle limit. An unreachable server is an
        error result (the call may or may not have reached it), and so is its refusal."""
        try:
            result = await self._connection.call(
                self._tool,
                arguments,
                meta={IDEMPOTENCY_META: invocation.idempotency_key},
                on_progress=invocation.heartbeat.beat,
            )
        except McpUnavailable as unavailable:
            return ToolOutput(
                content=f"{unavailable}. The call may or may not have reached the server.",
                is_error=True,
            )
        except McpRefused as refused:
            return ToolOutput(content=str(refused), is_error=True)
        cut = (result.meta or {}).get(CUT_META)
        if isinstance(cut, dict):  # an answer over the bound, made up from its start
            return ToolOutput(content=text_of(result), is_error=cut.get("isError") is True)
        return ToolOutput(content=text_of(result), is_error=result.is_error)


def descriptor_of(name: str, tool: mcp_types.Tool) -> ToolDescriptor:
    """The descriptor the model is shown for ``tool`` under ``name``."""
    return ToolDescriptor.of(name, tool.description or "", dict(tool.input_schema))


def text_of(result: mcp_types.CallToolResult) -> str:
    """What the model is shown of a tool's result: its text parts, one after another; a
    part of another kind is named (an image by its type and size); the structured result
    when there is no text."""
    import mcp_types  # loaded by the connection that answered (see _connection's docstring)

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}, {len(block.data)} base64 characters]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource: Any = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource: {resource.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', type(block).__name__)}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)
