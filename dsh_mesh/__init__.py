"""dsh-mesh: a multi-host runtime for cooperating LLM agents.

The public surface is re-exported from the layer packages: :mod:`dsh_mesh.core` (semantics),
:mod:`dsh_mesh.models` (providers), :mod:`dsh_mesh.tools`, :mod:`dsh_mesh.agent` and
:mod:`dsh_mesh.runtime` (the continuation manager). ``dsh_mesh.tool`` and
``dsh_mesh.ToolContext`` are :func:`dsh_mesh.tools.tool` and :class:`dsh_mesh.tools.ToolContext`,
for modules of Python tools (docs/tools.md); they are loaded on first use, so importing
``dsh_mesh`` alone stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsh_mesh.tools import ToolContext, tool

__all__ = ["ToolContext", "tool"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dsh_mesh import tools

        return getattr(tools, name)
    raise AttributeError(f"module 'dsh_mesh' has no attribute {name!r}")
