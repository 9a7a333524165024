"""The demo's MCP server: searches this project's docs. A real MCP server over stdio (the
official SDK's ``MCPServer``), launched by each node that uses it:
``python -m dsh_mesh.demo.docs_server DOCS_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer


def build(docs: Path) -> MCPServer:
    server = MCPServer("dsh-demo-docs")

    @server.tool()
    def search_docs(term: str, limit: int = 5) -> str:
        """Find the lines of the project's docs that mention a term (case-insensitive)."""
        found = []
        for path in sorted(docs.glob("*.md")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if term.lower() in line.lower():
                    found.append(f"{path.name}:{number}: {line.strip()}")
                    if len(found) >= limit:
                        return "\n".join(found)
        return "\n".join(found) or f"no doc mentions {term!r}"

    return server


if __name__ == "__main__":
    build(Path(sys.argv[1])).run("stdio")
