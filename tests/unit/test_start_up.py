"""What a process loads when it starts. A node with no MCP server never loads the MCP SDK (it
was half of a node's start-up), and a command of the CLI other than ``up`` loads neither the
node nor the local cluster's code. Each import runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys


def _loaded(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(run.stdout))


def test_a_node_loads_the_mcp_sdk_only_with_its_first_connection() -> None:
    loaded = _loaded("dsh_mesh.node")
    assert "dsh_mesh.mcp" in loaded  # the node composes MCP servers...
    assert {"mcp", "mcp_types", "httpx2"}.isdisjoint(loaded)  # ...whose SDK waits for one


def test_a_command_other_than_up_loads_neither_the_node_nor_the_test_bed() -> None:
    loaded = _loaded("dsh_mesh.cli")
    assert "dsh_mesh.client" in loaded
    assert not {m for m in loaded if m.startswith(("dsh_mesh.node", "dsh_mesh.testing", "mcp"))}
