"""MCP servers as tools: one connection per node per server (stdio or streamable HTTP, through
the official ``mcp`` SDK), their tools under ``<server>__<tool>`` names, the call limits and the
replay promise of every user tool (docs/tools.md)."""

from dsh_mesh.mcp._config import SELECTOR_PREFIX, McpServerConfig, split_tool_name
from dsh_mesh.mcp._connection import McpConnection, McpUnavailable
from dsh_mesh.mcp._servers import McpServers
from dsh_mesh.mcp._tool import IDEMPOTENCY_META, McpTool, descriptor_of, text_of

__all__ = [
    "IDEMPOTENCY_META",
    "SELECTOR_PREFIX",
    "McpConnection",
    "McpServerConfig",
    "McpServers",
    "McpTool",
    "McpUnavailable",
    "descriptor_of",
    "split_tool_name",
    "text_of",
]
