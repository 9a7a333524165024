"""The demo's Python tool: its researchers read this project's docs (``[tools]``-style, passed
to every node through the demo's scenario)."""

from __future__ import annotations

from pathlib import Path

from dsh_mesh.tools import ToolOutput, tool

DOCS = Path(__file__).resolve().parents[2] / "docs"
"""This repository's ``docs/`` (the demo runs from a checkout)."""


@tool(replay="safe", timeout_s=10)
def read_doc(name: str, max_lines: int = 12) -> str | ToolOutput:
    """Read the start of one of the project's docs.

    Args:
        name: The doc's file name, for example "contract.md".
        max_lines: At most this many lines are returned.
    """
    path = DOCS / name
    if "/" in name or not path.is_file():
        known = ", ".join(sorted(p.name for p in DOCS.glob("*.md")))
        return ToolOutput(content=f"no doc {name!r}; the docs are: {known}", is_error=True)
    lines = path.read_text().splitlines()[: max(1, max_lines)]
    return "\n".join(lines)
